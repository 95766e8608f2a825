"""The batcher task driven by trio's MockClock: exact batch compositions and times."""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import trio
import trio.testing

from trioserve import (
    DynamicBatching,
    InferenceRequest,
    InputTensor,
    InternalError,
    InvalidArgumentError,
    TensorSpec,
    UnavailableError,
    model,
)
from trioserve._tensor import datatype
from trioserve.scheduler._runner import ModelRunner

COMPUTE_S = 0.010


class Recorder:
    """A model whose executions take COMPUTE_S and are logged as (start, request ids)."""

    def __init__(self, max_batch_size=4, instances=1, fail=False, **batching):
        self.executions: list[tuple[float, list[int]]] = []
        self.fail = fail

        @model(
            name="recorder",
            inputs=[TensorSpec("X", "INT32", [1])],
            outputs=[TensorSpec("Y", "INT32", [1])],
            max_batch_size=max_batch_size,
            instance_count=instances,
            dynamic_batching=DynamicBatching(**batching),
        )
        async def recorder(X):
            self.executions.append((trio.current_time(), X.reshape(-1).tolist()))
            await trio.sleep(COMPUTE_S)
            if self.fail:
                raise RuntimeError("boom")
            return {"Y": X * 10}

        self.runner = ModelRunner(recorder, "1")


def request(i: int, rows: int = 1, **parameters) -> InferenceRequest:
    data = np.full((rows, 1), i, dtype=np.int32)
    tensor = InputTensor("X", datatype("INT32"), data.shape, data)
    return InferenceRequest("recorder", "", {"X": tensor}, parameters=parameters)


async def submit_at(nursery, runner, schedule, results):
    """Submit request i at time schedule[i] (seconds from now); results[i] = (time, outcome)."""
    start = trio.current_time()

    async def one(i, at, parameters):
        await trio.sleep_until(start + at)
        try:
            response = await runner.infer(request(i, **parameters))
            outcome = int(response.outputs[0].data.reshape(-1)[0])
        except Exception as exc:
            outcome = exc
        results[i] = (round(trio.current_time() - start, 6), outcome)

    for i, entry in enumerate(schedule):
        at, parameters = entry if isinstance(entry, tuple) else (entry, {})
        nursery.start_soon(one, i, at, parameters)


async def run(recorder, schedule):
    results: dict[int, tuple[float, object]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.runner.run)
        t0 = trio.current_time()
        async with trio.open_nursery() as clients:
            await submit_at(clients, recorder.runner, schedule, results)
        nursery.cancel_scope.cancel()
    executions = [(round(t - t0, 6), ids) for t, ids in recorder.executions]
    return executions, results


async def test_burst_fills_a_batch_and_the_rest_waits_for_a_free_instance(autojump_clock):
    rec = Recorder(max_batch_size=4, max_queue_delay_microseconds=2000)
    executions, results = await run(rec, [0, 0.0001, 0.0002, 0.0003, 0.0004])
    # The 4th request fills the batch at 0.3 ms; the 5th waits for the instance.
    assert executions == [(0.0003, [0, 1, 2, 3]), (0.0103, [4])]
    assert results == {
        0: (0.0103, 0),
        1: (0.0103, 10),
        2: (0.0103, 20),
        3: (0.0103, 30),
        4: (0.0203, 40),
    }


async def test_a_lone_request_waits_exactly_the_queue_delay(autojump_clock):
    rec = Recorder(max_batch_size=4, max_queue_delay_microseconds=2000)
    executions, results = await run(rec, [0, 0.0015])
    assert executions == [(0.002, [0, 1])]
    assert results[1] == (0.012, 10)


async def test_preferred_batch_size_goes_before_the_delay(autojump_clock):
    rec = Recorder(max_batch_size=8, max_queue_delay_microseconds=5000, preferred_batch_size=[2])
    executions, _ = await run(rec, [0, 0.001, 0.002])
    assert executions == [(0.001, [0, 1]), (0.011, [2])]


async def test_batch_sizes_count_rows_not_requests(autojump_clock):
    rec = Recorder(max_batch_size=4, max_queue_delay_microseconds=2000)
    results: dict[int, tuple[float, object]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(rec.runner.run)

        async def one(i, rows):
            response = await rec.runner.infer(request(i, rows))
            results[i] = (trio.current_time(), response.outputs[0].data.reshape(-1).tolist())

        async with trio.open_nursery() as clients:
            clients.start_soon(one, 1, 3)
            await trio.sleep(0.0001)
            clients.start_soon(one, 2, 2)  # 3 + 2 > 4: cannot join, the first goes alone
        nursery.cancel_scope.cancel()
    assert [ids for _, ids in rec.executions] == [[1, 1, 1], [2, 2]]
    assert results[1][1] == [10, 10, 10] and results[2][1] == [20, 20]


async def test_queue_timeout_rejects_at_the_deadline(autojump_clock):
    rec = Recorder(max_batch_size=1, max_queue_delay_microseconds=0)
    # Request 1 waits behind request 0's execution and gives up after 3 ms.
    executions, results = await run(rec, [0, (0.001, {"timeout": 3000})])
    assert executions == [(0.0, [0])]
    time, outcome = results[1]
    assert time == 0.004  # arrived at 1 ms
    assert isinstance(outcome, UnavailableError) and "timeout" in outcome.message


async def test_default_queue_timeout(autojump_clock):
    rec = Recorder(max_batch_size=1, default_timeout_microseconds=4000)
    _, results = await run(rec, [0, 0.001])
    assert results[1][0] == 0.005 and isinstance(results[1][1], UnavailableError)


async def test_full_queue_rejects_at_once(autojump_clock):
    rec = Recorder(max_batch_size=1, max_queue_size=1)
    executions, results = await run(rec, [0, 0.001, 0.002])
    assert [ids for _, ids in executions] == [[0], [1]]
    time, outcome = results[2]
    assert time == 0.002
    assert isinstance(outcome, UnavailableError) and "maximum queue size" in outcome.message


async def test_cancelled_request_leaves_the_queue_and_frees_its_slot(autojump_clock):
    rec = Recorder(max_batch_size=1, max_queue_size=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(rec.runner.run)
        async with trio.open_nursery() as clients:
            clients.start_soon(rec.runner.infer, request(0))  # executes 0..10 ms
            await trio.sleep(0.001)
            with trio.move_on_after(0.002) as scope:  # queued, then given up at 3 ms
                await rec.runner.infer(request(1))
            assert scope.cancelled_caught
            # The slot is free again: this one is queued, not rejected.
            response = await rec.runner.infer(request(2))
            assert response.outputs[0].data.item() == 20
            assert trio.current_time() == pytest.approx(0.020, abs=1e-9)
        nursery.cancel_scope.cancel()
    assert [ids for _, ids in rec.executions] == [[0], [2]]


async def test_higher_priority_overtakes(autojump_clock):
    rec = Recorder(max_batch_size=1, priority_levels=2, default_priority_level=2)
    executions, _ = await run(rec, [0, (0.001, {}), (0.002, {"priority": 1})])
    assert [ids for _, ids in executions] == [[0], [2], [1]]


async def test_instances_execute_concurrently(autojump_clock):
    rec = Recorder(max_batch_size=1, instances=2)
    executions, results = await run(rec, [0, 0, 0])
    assert sorted(t for t, _ in executions) == [0.0, 0.0, 0.01]
    assert sorted(t for t, _ in results.values()) == [0.01, 0.01, 0.02]


async def test_model_failure_fails_every_request_of_the_batch(autojump_clock):
    rec = Recorder(max_batch_size=4, max_queue_delay_microseconds=1000, fail=True)
    _, results = await run(rec, [0, 0])
    for _, outcome in results.values():
        assert isinstance(outcome, InternalError) and "boom" in outcome.message


async def test_invalid_requests_never_reach_the_queue(autojump_clock):
    rec = Recorder(max_batch_size=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(rec.runner.run)
        too_big = request(0, rows=5)
        with pytest.raises(InvalidArgumentError, match="batch size 5"):
            await rec.runner.infer(too_big)
        with pytest.raises(InvalidArgumentError, match="priority"):
            await rec.runner.infer(request(0, priority=-1))
        nursery.cancel_scope.cancel()
    assert rec.executions == []


async def test_stopping_the_runner_fails_what_is_queued_or_executing(autojump_clock):
    rec = Recorder(max_batch_size=1)
    outcomes: dict[int, str] = {}

    async def client(i):
        try:
            await rec.runner.infer(request(i))
            outcomes[i] = "ok"
        except UnavailableError as exc:
            outcomes[i] = exc.message

    async with trio.open_nursery() as clients, trio.open_nursery() as runner_nursery:
        await runner_nursery.start(rec.runner.run)
        clients.start_soon(client, 0)  # executing when the runner stops
        await trio.sleep(0.001)
        clients.start_soon(client, 1)  # queued when the runner stops
        await trio.sleep(0.001)
        runner_nursery.cancel_scope.cancel()
    assert outcomes == {0: "server is shutting down", 1: "server is shutting down"}
    assert rec.runner.ready is False


async def test_a_finished_request_is_freed_without_the_garbage_collector(nursery):
    """Nothing a request leaves behind refers back to it, so its tensors go as soon as the
    last reference does: a shared-memory region in use is released right then."""
    recorder = Recorder()
    await nursery.start(recorder.runner.run)
    gc.collect()
    gc.disable()
    try:
        withdrawn_request = request(2)
        done = request(1)
        inputs = [weakref.ref(r.inputs["X"].data) for r in (done, withdrawn_request)]
        response = await recorder.runner.infer(done)
        output = weakref.ref(response.outputs[0].data)
        ticket = recorder.runner.submit(withdrawn_request)
        ticket.withdraw()  # before the batcher saw it
        await trio.testing.wait_all_tasks_blocked()
        del done, withdrawn_request, response, ticket
        assert [ref() for ref in inputs] == [None, None]
        assert output() is None
    finally:
        gc.enable()


async def test_after_batch_runs_once_when_every_request_of_the_batch_has_its_outcome(
    autojump_clock,
):
    """Owners of several requests of one batch (a worker's link) ask, from each request's
    callback, for one call once the batch's requests all have their outcomes: it comes
    once, right as the batch ends; a request that finishes on its own gets no call."""
    recorder = Recorder(max_batch_size=4, max_queue_delay_microseconds=2000)
    asked: list[tuple[int, bool]] = []  # (request, whether a call will come)
    flushes: list[tuple[float, list[bool]]] = []  # (when, each ticket finished)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.runner.run)
        tickets = [recorder.runner.submit(request(i)) for i in range(4)]

        def flush() -> None:
            flushes.append((trio.current_time(), [t.finished for t in tickets]))

        for i, ticket in enumerate(tickets):
            ticket.when_finished(lambda i=i, t=ticket: asked.append((i, t.after_batch(flush))))
        tickets[3].withdraw()  # before the batcher saw it
        await trio.testing.wait_all_tasks_blocked()
        assert asked == [(3, False)] and flushes == []
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert [ids for _, ids in recorder.executions] == [[0, 1, 2]]
    assert sorted(asked) == [(0, True), (1, True), (2, True), (3, False)]
    assert flushes == [(0.002 + COMPUTE_S, [True, True, True, True])]
    assert [t.response.outputs[0].data.item() for t in tickets[:3]] == [0, 10, 20]


def _wake_ups(runner: ModelRunner) -> list[list[object]]:
    """What the batcher's task takes from its inbox each time it wakes, from now on."""
    inbox = runner._inbox
    take, woken = inbox.take, []

    async def counted_take(deadline: float = math.inf) -> list[object]:
        items = await take(deadline)
        woken.append(items)
        return items

    inbox.take = counted_take  # type: ignore[method-assign]
    return woken


async def test_an_idle_instance_decides_in_the_batchers_stead(autojump_clock):
    """Requests that find the batcher asleep with nothing timed and an instance idle are
    batched by that instance as it next runs, as the batcher would have then (those of
    one turn together), without a turn of the batcher's own; those that arrive while
    every instance is busy wait for the batcher as before."""
    recorder = Recorder(max_batch_size=4)
    woken = _wake_ups(recorder.runner)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.runner.run)
        await trio.testing.wait_all_tasks_blocked()  # the instance waits for a batch
        first = [recorder.runner.submit(request(i)) for i in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        woken_while_idle = len(woken)
        await trio.sleep(COMPUTE_S / 2)  # the instance is busy
        later = [recorder.runner.submit(request(i)) for i in range(3, 5)]
        await trio.sleep(COMPUTE_S * 3)
        nursery.cancel_scope.cancel()
    assert woken_while_idle == 0 and len(woken) == 1
    assert recorder.executions == [(0.0, [0, 1, 2]), (COMPUTE_S, [3, 4])]
    assert [t.response.outputs[0].data.item() for t in first + later] == [0, 10, 20, 30, 40]


async def test_with_a_queue_delay_the_batcher_decides_and_times_it(autojump_clock):
    """Where a batch waits out a queue delay, the batcher decides (it times the delay): a
    request that finds an instance idle wakes the batcher, not the instance."""
    recorder = Recorder(max_batch_size=4, max_queue_delay_microseconds=2000)
    woken = _wake_ups(recorder.runner)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.runner.run)
        await trio.testing.wait_all_tasks_blocked()  # the instance waits for a batch
        ticket = recorder.runner.submit(request(7))
        await trio.testing.wait_all_tasks_blocked()
        assert woken == [[ticket]] and recorder.executions == []  # the batcher took it
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert recorder.executions == [(0.002, [7])]
    assert ticket.response is not None and ticket.response.outputs[0].data.item() == 70
