"""Alike INFERs of one write, sent as one INFERS, queued as one request
(``workers/_coalesce.py``), spoken to in process by a test playing the worker (real
socket pair, real frames, merged and cut as a worker does): each is answered with its
own rows and counted as a request of its own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
import trio

from trioserve import DynamicBatching, Model, TensorSpec
from trioserve._model import FunctionModel
from trioserve._server import Server
from trioserve._tensor import DATATYPES, array_from_own_raw
from trioserve._types import InferenceRequest
from trioserve.testing import FailureReason, gated, model_statistics, open_test_server
from trioserve.tracing import TraceConfig
from trioserve.workers._wire import CANCEL, INFER, OUTCOME

from ._link_worker import Worker

Executions = list[list[int]]  # per execution, the rows of each request it was given


class Pair:
    """A model of INPUT0 and INPUT1 whose executions are noted and may be held."""

    def __init__(self) -> None:
        self.executions: Executions = []
        self.gate = trio.Event()  # executions wait for it
        self.gate.set()

    def model(
        self, name: str = "pair", own_execute: bool = False, text: bool = False, **settings: Any
    ) -> Model:
        executions, pair = self.executions, self

        class Noted(FunctionModel):  # its execute stays FunctionModel's
            def _stack(self, requests: Sequence[InferenceRequest]) -> Any:
                executions.append([request.inputs["INPUT0"].shape[0] for request in requests])
                return super()._stack(requests)

        class OwnExecute(Noted):  # a subclass's execute may look at each request
            def execute(self, requests: Sequence[InferenceRequest]) -> Any:
                return super().execute(requests)

        async def function(INPUT0: np.ndarray[Any, Any], INPUT1: np.ndarray[Any, Any]) -> Any:
            await pair.gate.wait()
            if (INPUT0 < 0).any():
                raise ValueError("negative")
            outputs = {"SUM": INPUT0 + INPUT1, "DIFF": INPUT0 - INPUT1}
            if text:
                outputs["TEXT"] = np.vectorize(lambda v: str(v).encode(), otypes=[object])(INPUT0)
            return outputs

        spec = [TensorSpec(name, "INT32", [4]) for name in ("INPUT0", "INPUT1")]
        settings.setdefault("dynamic_batching", DynamicBatching())
        outputs = [TensorSpec(name, "INT32", [4]) for name in ("SUM", "DIFF")]
        if text:  # not in the frame as raw bytes: each member's is packed on its own
            outputs.append(TensorSpec("TEXT", "BYTES", [4]))
        kind = OwnExecute if own_execute else Noted
        return kind(function, name=name, inputs=spec, outputs=outputs, max_batch_size=8, **settings)


def _infer(
    call: int, rows: int = 1, model: str = "pair", width: int = 4, **fields: Any
) -> tuple[Any, ...]:
    """An INFER of ``rows`` rows whose INPUT0 starts at ``call``'s value (its own)."""
    first = np.arange(rows * width, dtype=np.int32).reshape(rows, width) + 100 * abs(call)
    if fields.get("negative"):
        first = -first
    second = np.full((rows, width), 7, np.int32)
    inputs = [
        ("INPUT0", "INT32", (rows, width), first.tobytes(), {}),
        ("INPUT1", "INT32", (rows, width), second.tobytes(), {}),
    ]
    parameters, trace = fields.get("parameters", {}), fields.get("trace")
    return (
        INFER,
        call,
        "HTTP end point",
        model,
        "",
        f"id{call}",
        parameters,
        inputs,
        [],
        None,
        trace,
    )


def _check_answer(call: int, outcome: tuple[Any, ...], rows: int = 1) -> None:
    """``outcome`` is ``call``'s own: its id, its rows' sum and difference."""
    assert outcome[0] == OUTCOME and outcome[1] is None, outcome
    assert outcome[4] == f"id{call}"
    first = np.arange(rows * 4, dtype=np.int32).reshape(rows, 4) + 100 * abs(call)
    tensors = {
        name: array_from_own_raw(DATATYPES[kind], shape, data)
        for name, kind, shape, data, _ in outcome[6]
    }
    np.testing.assert_array_equal(tensors["SUM"], first + 7)
    np.testing.assert_array_equal(tensors["DIFF"], first - 7)


async def _outcomes(worker: Worker, count: int) -> dict[int, tuple[Any, ...]]:
    outcomes: dict[int, tuple[Any, ...]] = {}
    while len(outcomes) < count:
        for frame in await worker.outcomes():
            outcomes.update(frame)
    assert len(outcomes) == count
    return outcomes


@pytest.fixture
def pair() -> Pair:
    return Pair()


@pytest.fixture
async def server(pair: Pair) -> AsyncIterator[Server]:
    wrapped = gated(pair.model("wrapped"))  # not a FunctionModel: its execute is its own
    wrapped.release.set()
    models = [
        pair.model(),
        pair.model("preferring", dynamic_batching=DynamicBatching(preferred_batch_size=[4])),
        pair.model("limited", dynamic_batching=DynamicBatching(max_queue_size=50)),
        pair.model("unbatched", dynamic_batching=None),
        pair.model("own_execute", own_execute=True),
        pair.model("text", text=True),
        wrapped,
    ]
    async with open_test_server(models) as server:
        yield server


async def _queued(server: Server, count: int, model: str = "pair") -> None:
    await server.repository.get(model).wait_until(lambda stats: stats.queued == count)  # type: ignore[attr-defined]


async def test_alike_inferences_run_as_one_request_each_answered_with_its_rows(
    autojump_clock: trio.abc.Clock, server: Server, pair: Pair, worker: Worker
) -> None:
    await worker.send_together(*[_infer(-call) for call in range(1, 6)])
    outcomes = await _outcomes(worker, 5)
    for call, outcome in outcomes.items():
        _check_answer(call, outcome)
    assert pair.executions == [[5]]  # one request of their five rows
    statistics = model_statistics(server, "pair")
    assert (statistics.success.count, statistics.inference_count) == (5, 5)
    assert statistics.execution_count == 1
    assert statistics.queue.count == 5 and statistics.compute_infer.count == 5


async def test_outputs_that_do_not_ride_in_the_frame_raw_are_cut_per_request(
    autojump_clock: trio.abc.Clock, pair: Pair, worker: Worker
) -> None:
    await worker.send_together(*[_infer(-call, model="text") for call in range(1, 4)])
    for call, outcome in (await _outcomes(worker, 3)).items():
        _check_answer(call, outcome)
        (text,) = [tensor for tensor in outcome[6] if tensor[0] == "TEXT"]
        values = array_from_own_raw(DATATYPES["BYTES"], text[2], text[3])
        assert values.tolist() == [[str(v).encode() for v in np.arange(4) + 100 * abs(call)]]
    assert pair.executions == [[3]]


async def test_inferences_that_differ_go_alone(
    autojump_clock: trio.abc.Clock, pair: Pair, worker: Worker
) -> None:
    pair.gate = trio.Event()  # held, so that the batcher takes all of them at once
    await worker.send_together(
        _infer(-1),
        _infer(-2, rows=2),  # another shape
        _infer(-3, trace={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}),
        _infer(-4),
        _infer(-5, parameters={"priority": 1}),  # other parameters
        _infer(-6, parameters={"priority": 1}),
    )
    await trio.testing.wait_all_tasks_blocked()
    pair.gate.set()
    outcomes = await _outcomes(worker, 6)
    for call, outcome in outcomes.items():
        _check_answer(call, outcome, rows=2 if call == -2 else 1)
    # -1 and -4 as one request, -5 and -6 as another; -2 and -3 alone.
    assert sorted(rows for execution in pair.executions for rows in execution) == [1, 2, 2, 2]


@pytest.mark.parametrize("model", ["limited", "unbatched", "own_execute", "wrapped"])
async def test_a_model_whose_requests_are_more_than_their_rows_takes_them_one_by_one(
    autojump_clock: trio.abc.Clock, server: Server, pair: Pair, worker: Worker, model: str
) -> None:
    await worker.send_together(*[_infer(-call, model=model) for call in range(1, 4)])
    for call, outcome in (await _outcomes(worker, 3)).items():
        _check_answer(call, outcome)
    assert [rows for execution in pair.executions for rows in execution] == [1, 1, 1]
    assert model_statistics(server, model).success.count == 3


async def test_no_request_is_coalesced_while_requests_are_traced(pair: Pair) -> None:
    settings = {"trace": TraceConfig(level=("TIMESTAMPS",), rate=1000)}
    async with open_test_server([pair.model()], **settings) as server:
        assert server.context is not None
        runner = server.repository.get("pair")
        assert server.context.pipeline.coalescing(runner) is None
        server.context.tracing.update("", {"trace_level": ["OFF"]})
        assert server.context.pipeline.coalescing(runner) is runner


async def test_a_group_goes_in_requests_of_at_most_a_batch(
    autojump_clock: trio.abc.Clock, pair: Pair, worker: Worker
) -> None:
    await worker.send_together(*[_infer(-call) for call in range(1, 21)])
    for call, outcome in (await _outcomes(worker, 20)).items():
        _check_answer(call, outcome)
    assert pair.executions == [[8], [8], [4]]  # max_batch_size 8


async def test_a_group_goes_in_requests_of_the_largest_preferred_batch(
    autojump_clock: trio.abc.Clock, pair: Pair, worker: Worker
) -> None:
    await worker.send_together(*[_infer(-call, model="preferring") for call in range(1, 11)])
    for call, outcome in (await _outcomes(worker, 10)).items():
        _check_answer(call, outcome)
    assert [rows for execution in pair.executions for rows in execution] == [4, 4, 2]


async def test_a_cancel_leaves_the_others_answered_and_all_cancelled_withdraw_it(
    autojump_clock: trio.abc.Clock, server: Server, pair: Pair, worker: Worker
) -> None:
    pair.gate = trio.Event()
    await worker.send_together(_infer(-1))
    await trio.testing.wait_all_tasks_blocked()  # -1 executes, held at the gate
    await worker.send_together(_infer(-2), _infer(-3), _infer(-4), (CANCEL, -3))
    await worker.send_together(_infer(-5), _infer(-6), (CANCEL, -5), (CANCEL, -6))
    await trio.testing.wait_all_tasks_blocked()
    # The second group is withdrawn; the first waits, each of its requests counted.
    assert model_statistics(server, "pair").pending == 3
    pair.gate.set()
    outcomes = await _outcomes(worker, 3)
    assert sorted(outcomes) == [-4, -2, -1]  # -3 is not answered
    for call, outcome in outcomes.items():
        _check_answer(call, outcome)
    assert pair.executions == [[1], [3]]  # -3's rows ran with the others'
    statistics = model_statistics(server, "pair")
    assert statistics.failures[FailureReason.CANCELED] == 2  # -5 and -6
    assert statistics.success.count == 4


async def test_a_failure_answers_each_of_the_group_with_its_error(
    autojump_clock: trio.abc.Clock, server: Server, worker: Worker
) -> None:
    await worker.send_together(_infer(-1), _infer(-2, negative=True), _infer(-3))
    outcomes = await _outcomes(worker, 3)
    errors = {outcome[1] for outcome in outcomes.values()}
    assert len(errors) == 1  # the same for each, as for the requests of a failed batch
    (kind, message), *_ = errors
    assert kind == "INTERNAL" and "negative" in message
    statistics = model_statistics(server, "pair")
    assert statistics.failures[FailureReason.BACKEND] == 3
    assert statistics.fail.count == 3 and statistics.success.count == 0


async def test_the_groups_of_a_worker_that_leaves_are_withdrawn(
    autojump_clock: trio.abc.Clock, server: Server, pair: Pair, worker: Worker
) -> None:
    pair.gate = trio.Event()
    await worker.send_together(_infer(-1))
    await trio.testing.wait_all_tasks_blocked()
    await worker.send_together(_infer(-2), _infer(-3), _infer(-4))
    await trio.testing.wait_all_tasks_blocked()
    assert model_statistics(server, "pair").pending == 3
    worker.channel.close()
    await _queued(server, 0)
    pair.gate.set()
    await server.repository.get("pair").wait_until(lambda stats: not stats.executing)  # type: ignore[attr-defined]
    statistics = model_statistics(server, "pair")
    assert statistics.failures[FailureReason.CANCELED] == 4  # the one executing too
    assert pair.executions == [[1]]  # the group never ran


async def test_alike_inferences_the_model_refuses_are_refused_each_as_it_came(
    autojump_clock: trio.abc.Clock, server: Server, pair: Pair, worker: Worker
) -> None:
    no_inputs = (*_infer(-5)[:7], [], *_infer(-5)[8:])
    await worker.send_together(
        _infer(-1, width=5), _infer(-2, width=5),  # alike, and of a shape the model refuses
        _infer(-3, rows=0), _infer(-4, rows=0),  # no rows
        no_inputs, (*no_inputs[:1], -6, *no_inputs[2:]),
        _infer(-7), _infer(-8),
    )  # fmt: skip
    outcomes = await _outcomes(worker, 8)
    for call in (-1, -2):  # each error names the shape its request had
        kind, message = outcomes[call][1]
        assert kind == "INVALID_ARG" and "[1,5]" in message.replace(" ", ""), message
    for call in (-5, -6):
        assert outcomes[call][1] is not None
    _check_answer(-7, outcomes[-7])
    _check_answer(-8, outcomes[-8])
    assert [8] not in pair.executions  # nothing was stacked with the refused ones
    assert model_statistics(server, "pair").success.count == 2 + sum(
        outcome[1] is None for call, outcome in outcomes.items() if call in (-3, -4)
    )


async def test_alike_inferences_to_a_model_not_served_are_each_refused(
    autojump_clock: trio.abc.Clock, worker: Worker
) -> None:
    await worker.send_together(*[_infer(-call, model="absent") for call in range(1, 4)])
    outcomes = await _outcomes(worker, 3)
    for outcome in outcomes.values():
        kind, message = outcome[1]
        assert kind == "NOT_FOUND" and "absent" in message, message
