"""The sequence batcher task under trio's MockClock: exact times, batches and states."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

from trioserve import (
    DynamicBatching,
    InferenceRequest,
    InputTensor,
    InvalidArgumentError,
    Model,
    SequenceBatching,
    SequenceControl,
    SequenceState,
    TensorSpec,
    model,
)
from trioserve._tensor import datatype
from trioserve.scheduler._sequence_runner import SequenceRunner, sequence_flags

COMPUTE_S = 0.010


class Accumulator:
    """Y = the sum of a sequence's X so far (kept in implicit state), plus the correlation
    id on its END request. Executions are logged as (time, [(corrid, start, x)])."""

    def __init__(self, max_batch_size: int = 2, **settings: Any) -> None:
        self.executions: list[tuple[float, list[tuple[int, int, int]]]] = []
        batching = SequenceBatching(
            controls=[
                SequenceControl("START", "START", "BOOL", (False, True)),
                SequenceControl("END", "END", "FP32", (0.0, 1.0)),
                SequenceControl("CORRID", "CORRID", "UINT64"),
            ],
            states=[SequenceState("SUM_IN", "SUM_OUT", "INT32", [1])],
            **settings,
        )

        @model(
            name="accumulator",
            inputs=[TensorSpec("X", "INT32", [1])],
            outputs=[TensorSpec("Y", "INT32", [1])],
            max_batch_size=max_batch_size,
            sequence_batching=batching,
        )
        async def accumulator(X, START, END, CORRID, SUM_IN):
            rows = zip(CORRID.reshape(-1), START.reshape(-1), X.reshape(-1), strict=True)
            self.executions.append(
                (round(trio.current_time(), 6), [(int(c), int(s), int(x)) for c, s, x in rows])
            )
            await trio.sleep(COMPUTE_S)
            total = SUM_IN + X
            return {"Y": total + END.astype(np.int64) * CORRID, "SUM_OUT": total}

        self.runner = SequenceRunner(accumulator, "1")


def request(
    x: int, corrid: int, *, start: bool = False, end: bool = False, batched: bool = True
) -> InferenceRequest:
    data = np.full((1, 1) if batched else (1,), x, dtype=np.int32)
    tensor = InputTensor("X", datatype("INT32"), data.shape, data)
    parameters = {"sequence_id": corrid, "sequence_start": start, "sequence_end": end}
    return InferenceRequest("accumulator", "", {"X": tensor}, parameters=parameters)


async def play(runner: SequenceRunner, schedule: list[tuple[float, InferenceRequest]]) -> list[Any]:
    """Submit each request at its time (in list order); each result is (time, Y or error)."""
    results: list[Any] = [None] * len(schedule)
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        start = trio.current_time()
        async with trio.open_nursery() as waiters:
            for index, (at, req) in enumerate(schedule):
                await trio.sleep_until(start + at)
                try:
                    ticket = runner.submit(req)
                except InvalidArgumentError as exc:
                    results[index] = (at, exc.message)
                    continue
                waiters.start_soon(wait, ticket, index, results, start)
        nursery.cancel_scope.cancel()
    return results


async def wait(ticket: Any, index: int, results: list[Any], start: float) -> None:
    await ticket.wait()
    try:
        outcome: Any = int(ticket.outcome().outputs[0].data.reshape(-1)[0])
    except Exception as exc:
        outcome = str(exc)
    results[index] = (round(trio.current_time() - start, 6), outcome)


async def test_a_sequence_runs_in_order_one_request_at_a_time(autojump_clock: Any) -> None:
    acc = Accumulator()
    results = await play(
        acc.runner,
        [(0, request(1, 7, start=True)), (0, request(2, 7)), (0, request(3, 7, end=True))],
    )
    assert acc.executions == [(0.0, [(7, 1, 1)]), (0.01, [(7, 0, 2)]), (0.02, [(7, 0, 3)])]
    assert results == [(0.01, 1), (0.02, 3), (0.03, 6 + 7)]


async def test_oldest_batches_across_sequences_within_the_delay(autojump_clock: Any) -> None:
    acc = Accumulator(strategy="oldest", max_queue_delay_microseconds=2000)
    results = await play(
        acc.runner,
        [
            (0.000, request(1, 1, start=True)),
            (0.001, request(10, 2, start=True)),
            (0.005, request(100, 3, start=True)),
            (0.005, request(2, 1)),
        ],
    )
    # 1 and 2 fill a batch at 1 ms; 1's second request and 3 (arrived together at 5 ms,
    # by slot) wait for the instance, busy until 11 ms.
    assert acc.executions == [(0.001, [(1, 1, 1), (2, 1, 10)]), (0.011, [(1, 0, 2), (3, 1, 100)])]
    assert [r[1] for r in results] == [1, 10, 100, 3]


async def test_oldest_waits_for_a_sequence_to_finish_its_request(autojump_clock: Any) -> None:
    acc = Accumulator(strategy="oldest", max_queue_delay_microseconds=2000)
    results = await play(
        acc.runner,
        [(0, request(1, 1, start=True)), (0, request(2, 1)), (0, request(5, 2, start=True))],
    )
    # The first requests of 1 and 2 fill a batch at once; 1's second request cannot join
    # it, and runs when the first is done, its delay long passed.
    assert acc.executions == [(0.0, [(1, 1, 1), (2, 1, 5)]), (0.01, [(1, 0, 2)])]
    assert [r[1] for r in results] == [1, 3, 5]


async def test_idle_sequences_are_released(autojump_clock: Any) -> None:
    acc = Accumulator(max_sequence_idle_microseconds=100_000)
    results = await play(
        acc.runner,
        [
            (0.00, request(1, 4, start=True)),
            (0.05, request(1, 4)),  # seen at 50 ms: idle from its end at 60 ms...
            (0.17, request(1, 4)),  # ...released at 160 ms
            (0.18, request(5, 4, start=True)),  # a new sequence starts from zero
        ],
    )
    assert results[:2] == [(0.01, 1), (0.06, 2)]
    assert results[2] == (
        0.17,
        "inference request for sequence 4 to model 'accumulator' must specify the START flag "
        "on the first request of the sequence",
    )
    assert results[3] == (0.19, 5)


async def test_a_start_queued_longer_than_the_idle_time_keeps_its_sequence(
    autojump_clock: Any,
) -> None:
    acc = Accumulator(max_batch_size=0, max_sequence_idle_microseconds=100_000)  # one slot
    results = await play(
        acc.runner,
        [
            (0.000, request(1, 1, start=True, batched=False)),
            (0.001, request(2, 2, start=True, batched=False)),  # in the backlog until 100 ms
            (0.090, request(3, 1, end=True, batched=False)),
            (0.150, request(4, 2, batched=False)),  # idle from its START's end at 110 ms
            (0.270, request(5, 2, batched=False)),  # idle since 160 ms: released at 260 ms
        ],
    )
    assert acc.executions == [
        (0.0, [(1, 1, 1)]),
        (0.09, [(1, 0, 3)]),
        (0.1, [(2, 1, 2)]),
        (0.15, [(2, 0, 4)]),
    ]
    assert results[:4] == [(0.01, 1), (0.11, 2), (0.1, 1 + 3 + 1), (0.16, 2 + 4)]
    assert results[4] == (
        0.27,
        "inference request for sequence 2 to model 'accumulator' must specify the START flag "
        "on the first request of the sequence",
    )


@pytest.mark.parametrize("corrid", [-(2**63) - 1, 2**64, 2**64 + 2])
def test_a_correlation_id_beyond_uint64_is_refused(corrid: int) -> None:
    with pytest.raises(InvalidArgumentError, match="must be a 64-bit unsigned integer"):
        sequence_flags(request(1, corrid, start=True))


def test_a_negative_int64_correlation_id_is_its_uint64() -> None:
    assert sequence_flags(request(1, -1, start=True))[0] == 2**64 - 1  # as gRPC's int64_param


async def test_sequences_beyond_the_slots_wait_for_one(autojump_clock: Any) -> None:
    acc = Accumulator(max_batch_size=0)  # one instance, one slot (direct)
    results = await play(
        acc.runner,
        [
            (0, request(1, 1, start=True, batched=False)),
            (0, request(2, 2, start=True, batched=False)),
            (0.001, request(3, 1, end=True, batched=False)),
            (0.001, request(4, 2, end=True, batched=False)),
        ],
    )
    # Sequence 2 waits in the backlog until sequence 1 ends and frees the one slot.
    assert acc.executions == [
        (0.0, [(1, 1, 1)]),
        (0.01, [(1, 0, 3)]),
        (0.02, [(2, 1, 2)]),
        (0.03, [(2, 0, 4)]),
    ]
    assert results == [(0.01, 1), (0.03, 2), (0.02, 1 + 3 + 1), (0.04, 2 + 4 + 2)]


async def test_a_cancelled_request_ends_its_sequence(autojump_clock: Any) -> None:
    acc = Accumulator()
    async with trio.open_nursery() as nursery:
        await nursery.start(acc.runner.run)
        acc.runner.submit(request(1, 9, start=True))
        with trio.move_on_after(0.001):
            await acc.runner.infer(request(2, 9))  # waits for the first; cancelled
        waiting = acc.runner.submit(request(3, 9))  # joins before the cancel is handled
        await waiting.wait()
        assert "sequence 9 was cancelled" in str(waiting.error)
        with pytest.raises(InvalidArgumentError, match="must specify the START flag"):
            acc.runner.submit(request(4, 9))
        await acc.runner.wait_until(lambda s: s.executing == 0)
        stats = acc.runner.inference_statistics()
        assert (stats.fail.count, stats.success.count, stats.pending) == (2, 1, 0)
        nursery.cancel_scope.cancel()


def test_the_model_config_reports_the_sequence_batcher() -> None:
    from trioserve._model_config import model_config

    acc = Accumulator(strategy="oldest", max_candidate_sequences=4)
    config = model_config(acc.runner.model)
    assert "dynamic_batching" not in config
    assert config["sequence_batching"] == {
        "max_sequence_idle_microseconds": 1_000_000,
        "oldest": {
            "max_queue_delay_microseconds": 0,
            "max_candidate_sequences": 4,
            "preferred_batch_size": [],
        },
        "control_input": [
            {
                "name": "START",
                "control": [{"kind": "CONTROL_SEQUENCE_START", "bool_false_true": [False, True]}],
            },
            {
                "name": "END",
                "control": [{"kind": "CONTROL_SEQUENCE_END", "fp32_false_true": [0.0, 1.0]}],
            },
            {
                "name": "CORRID",
                "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_UINT64"}],
            },
        ],
        "state": [
            {
                "input_name": "SUM_IN",
                "output_name": "SUM_OUT",
                "data_type": "TYPE_INT32",
                "dims": [1],
            }
        ],
    }


@pytest.mark.parametrize(
    "settings", [{"dynamic_batching": DynamicBatching()}, {"response_cache": True}]
)
def test_what_a_sequence_model_cannot_use(settings: dict[str, Any]) -> None:
    spec = [TensorSpec("X", "INT32", [1])]
    with pytest.raises(ValueError, match="the sequence batcher excludes"):
        Model(name="m", inputs=spec, outputs=[], sequence_batching=SequenceBatching(), **settings)


def corrid_echo(corrid_datatype: str) -> SequenceRunner:
    """Y = the CORRID control the batcher gave (a ``corrid_datatype`` control)."""
    batching = SequenceBatching(controls=[SequenceControl("CORRID", "CORRID", corrid_datatype)])

    @model(
        name="accumulator",
        inputs=[TensorSpec("X", "INT32", [1])],
        outputs=[TensorSpec("Y", "INT64", [1])],
        max_batch_size=2,
        sequence_batching=batching,
    )
    async def echo(X, CORRID):
        return {"Y": CORRID.astype(np.int64)}

    return SequenceRunner(echo, "1")


async def test_correlation_ids_must_fit_the_corrid_control(autojump_clock: Any) -> None:
    """An id the control cannot hold is refused on arrival: it once stopped the batcher
    (and the server) when the batcher wrote it into the control."""
    results = await play(
        corrid_echo("INT32"),
        [
            (0, request(1, 2**40, start=True, end=True)),
            (0, request(1, -5, start=True, end=True)),  # a negative int64 id: the same id
            (0, request(1, 2**31 - 1, start=True, end=True)),
        ],
    )
    assert results[0] == (
        0,
        "parameter 'sequence_id' 1099511627776 does not fit the INT32 control 'CORRID'",
    )
    assert results[1:] == [(0.0, -5), (0.0, 2**31 - 1)]


async def test_a_string_id_must_be_valid_unicode(autojump_clock: Any) -> None:
    results = await play(corrid_echo("BYTES"), [(0, request(1, "\ud800", start=True))])  # type: ignore[arg-type]
    assert results == [(0, "parameter 'sequence_id' is not valid Unicode text")]


async def test_a_fault_preparing_a_request_fails_it_not_the_batcher(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trioserve.scheduler import _sequence_runner

    tensor = _sequence_runner._tensor

    def faulty(name: str, wire: Any, dims: Any, value: Any, batched: bool) -> Any:
        if name == "CORRID" and value == 13:
            raise ValueError("a fault of this request's")
        return tensor(name, wire, dims, value, batched)

    monkeypatch.setattr(_sequence_runner, "_tensor", faulty)
    runner = corrid_echo("UINT64")
    results = await play(
        runner,
        [(0, request(1, 13, start=True, end=True)), (0.1, request(1, 14, start=True, end=True))],
    )
    assert results[0] == (
        0.0,
        "model 'accumulator' could not prepare the request: a fault of this request's",
    )
    assert results[1] == (0.1, 14)
    failures = runner.inference_statistics().failures
    assert {reason.value: n for reason, n in failures.items() if n} == {"OTHER": 1}
