"""Statistics a runner records, under trio's MockClock: exact counts and nanoseconds.

The model's compute is one ``trio.sleep(COMPUTE_S)`` per execution, and everything else
takes no virtual time, so every duration below is known exactly.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import trio

from trioserve import (
    DynamicBatching,
    InferenceRequest,
    InputTensor,
    InternalError,
    MemoryUsage,
    Model,
    RequestedOutput,
    TensorSpec,
    UnavailableError,
)
from trioserve._stats import BatchStat, DurationStat, FailureReason, Histogram
from trioserve._tensor import datatype
from trioserve.scheduler._cache import ResponseCache
from trioserve.scheduler._runner import ModelRunner

COMPUTE_S = 0.010
MS = 1_000_000  # ns


class Timed(Model):
    """Y = 10 * X after ``COMPUTE_S`` per execution; fails every execution when asked."""

    def __init__(self, fail: bool = False, max_batch_size: int = 4, **batching):
        super().__init__(
            name="timed",
            inputs=[TensorSpec("X", "INT32", [1])],
            outputs=[TensorSpec("Y", "INT32", [1]), TensorSpec("Z", "INT32", [1])],
            max_batch_size=max_batch_size,
            dynamic_batching=DynamicBatching(**batching),
        )
        self.fail = fail
        self.executions: list[list[int]] = []

    async def execute(self, requests):
        self.executions.append([int(r.inputs["X"].data[0, 0]) for r in requests])
        await trio.sleep(COMPUTE_S)
        if self.fail:
            raise RuntimeError("boom")
        return [{"Y": r.inputs["X"].data * 10, "Z": r.inputs["X"].data} for r in requests]

    def memory_usage(self):
        return [MemoryUsage("CPU", 0, 4096)]


def request(i: int, *, id: str = "", outputs=(), **parameters) -> InferenceRequest:
    data = np.full((1, 1), i, dtype=np.int32)
    return InferenceRequest(
        "timed",
        "",
        {"X": InputTensor("X", datatype("INT32"), data.shape, data)},
        outputs=[RequestedOutput(name) for name in outputs],
        id=id,
        parameters=parameters,
    )


async def traffic(runner: ModelRunner, schedule) -> dict[int, object]:
    """Submit request i at schedule[i] s (an (at, parameters) pair or a time); outcomes."""
    outcomes: dict[int, object] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        start = trio.current_time()

        async def one(i, at, parameters):
            await trio.sleep_until(start + at)
            try:
                outcomes[i] = await runner.infer(request(i, **parameters))
            except Exception as exc:
                outcomes[i] = exc

        async with trio.open_nursery() as clients:
            for i, entry in enumerate(schedule):
                at, parameters = entry if isinstance(entry, tuple) else (entry, {})
                clients.start_soon(one, i, at, parameters)
        nursery.cancel_scope.cancel()
    return outcomes


async def test_a_burst_that_batches(autojump_clock):
    model = Timed(max_queue_delay_microseconds=2000)
    runner = ModelRunner(model, "1", histogram_bounds_ns=(1 * MS, 10 * MS, 20 * MS))
    before_ms = time.time_ns() // 1_000_000
    await traffic(runner, [0, 0.0001, 0.0002, 0.0003, 0.0004])
    # Requests 0-3 fill a batch at 0.3 ms; request 4 waits for the instance until 10.3 ms.
    assert model.executions == [[0, 1, 2, 3], [4]]
    s = runner.inference_statistics()
    assert (s.name, s.version) == ("timed", "1")
    assert s.inference_count == 5 and s.execution_count == 2
    assert s.success == DurationStat(5, (10.3 + 10.2 + 10.1 + 10.0 + 19.9) * MS)
    assert s.queue == DurationStat(5, (0.3 + 0.2 + 0.1 + 0 + 9.9) * MS)
    # Each request reports the compute of the batch it was in.
    assert s.compute_infer == DurationStat(5, 5 * 10 * MS)
    assert s.compute_input == s.compute_output == DurationStat(5, 0)
    assert s.fail == s.cache_hit == s.cache_miss == DurationStat(0, 0)
    ten = DurationStat(1, 10 * MS)
    assert s.batch_stats == (
        BatchStat(1, DurationStat(1, 0), ten, DurationStat(1, 0)),
        BatchStat(4, DurationStat(1, 0), ten, DurationStat(1, 0)),
    )
    assert before_ms <= s.last_inference <= time.time_ns() // 1_000_000
    assert s.memory_usage == (MemoryUsage("CPU", 0, 4096),)
    assert s.pending == 0 and not s.response_cache
    # Buckets: <= 1 ms, <= 10 ms, <= 20 ms, above; a value equal to a bound is in it.
    bounds = (1 * MS, 10 * MS, 20 * MS)
    assert s.histograms == {
        "request": Histogram(bounds, (0, 1, 4, 0), s.success.ns),
        "queue": Histogram(bounds, (4, 1, 0, 0), s.queue.ns),
        "compute": Histogram(bounds, (0, 5, 0, 0), 50 * MS),
    }


async def test_batch_size_counts_rows(autojump_clock):
    model = Timed(max_batch_size=8, max_queue_delay_microseconds=1000)
    runner = ModelRunner(model, "1")
    rows = np.ones((3, 1), dtype=np.int32)
    three = InferenceRequest("timed", "", {"X": InputTensor("X", datatype("INT32"), (3, 1), rows)})
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        async with trio.open_nursery() as clients:
            clients.start_soon(runner.infer, three)
            clients.start_soon(runner.infer, request(7))
        nursery.cancel_scope.cancel()
    s = runner.inference_statistics()
    assert (s.inference_count, s.execution_count, s.success.count) == (4, 1, 2)
    assert [b.batch_size for b in s.batch_stats] == [4]


async def test_model_failure_counts_as_backend(autojump_clock):
    runner = ModelRunner(Timed(fail=True, max_queue_delay_microseconds=1000), "1")
    outcomes = await traffic(runner, [0, 0.0005])
    assert all(isinstance(o, InternalError) for o in outcomes.values())
    s = runner.inference_statistics()
    # Both wait for the 1 ms delay, then fail after the 10 ms execution.
    assert s.fail == DurationStat(2, (11 + 10.5) * MS)
    assert s.failures == {
        FailureReason.BACKEND: 2,
        FailureReason.REJECTED: 0,
        FailureReason.CANCELED: 0,
        FailureReason.OTHER: 0,
    }
    assert s.success.count == s.execution_count == s.inference_count == 0
    assert s.batch_stats == () and s.last_inference == 0


async def test_full_queue_and_queue_timeout_are_rejected(autojump_clock):
    model = Timed(max_batch_size=1, max_queue_size=1)
    runner = ModelRunner(model, "1")
    # 0 executes 0-10 ms; 1 waits in the queue; 2 finds it full at 2 ms; 3 arrives at
    # 11 ms behind 1 (executing 10-20 ms) and gives up after its 4 ms timeout.
    outcomes = await traffic(runner, [0, 0.001, 0.002, (0.011, {"timeout": 4000})])
    assert isinstance(outcomes[2], UnavailableError) and isinstance(outcomes[3], UnavailableError)
    s = runner.inference_statistics()
    assert s.failures[FailureReason.REJECTED] == 2
    assert s.fail == DurationStat(2, 0 + 4 * MS)
    assert s.success == DurationStat(2, (10 + 19) * MS)
    assert s.queue == DurationStat(2, (0 + 9) * MS)


async def test_cancellation_counts_as_canceled_with_its_wait(autojump_clock):
    runner = ModelRunner(Timed(max_batch_size=1), "1")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        async with trio.open_nursery() as clients:
            clients.start_soon(runner.infer, request(0))  # executes 0-10 ms
            await trio.sleep(0.001)
            with trio.move_on_after(0.002):  # queued at 1 ms, given up at 3 ms
                await runner.infer(request(1))
        nursery.cancel_scope.cancel()
    s = runner.inference_statistics()
    assert s.failures[FailureReason.CANCELED] == 1
    assert s.fail == DurationStat(1, 2 * MS)
    assert s.success == DurationStat(1, 10 * MS)


async def test_shutdown_fails_what_waits_as_other(autojump_clock):
    runner = ModelRunner(Timed(max_batch_size=1), "1")
    outcomes: list[object] = []

    async def client(i):
        try:
            await runner.infer(request(i))
        except UnavailableError as exc:
            outcomes.append(exc)

    async with trio.open_nursery() as clients, trio.open_nursery() as runner_nursery:
        await runner_nursery.start(runner.run)
        clients.start_soon(client, 0)  # executing when the runner stops at 4 ms
        await trio.sleep(0.001)
        clients.start_soon(client, 1)  # queued when it stops
        await trio.sleep(0.003)
        runner_nursery.cancel_scope.cancel()
    assert len(outcomes) == 2
    s = runner.inference_statistics()
    assert s.failures[FailureReason.OTHER] == 2
    assert s.fail == DurationStat(2, (4 + 3) * MS)


async def test_cache_hits_skip_the_model_and_count_as_success(autojump_clock):
    model = Timed(max_batch_size=1)
    runner = ModelRunner(model, "1", cache=ResponseCache(1 << 20))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        first = await runner.infer(request(3, id="a"))  # miss: executes, 10 ms
        second = await runner.infer(request(3, id="b"))  # hit: answered on arrival
        subset = await runner.infer(request(3, outputs=["Z"]))  # other outputs: a miss
        other = await runner.infer(request(4))  # other input: a miss
        nursery.cancel_scope.cancel()
    assert model.executions == [[3], [3], [4]]
    assert second.id == "b" and first.id == "a"
    assert [(t.name, t.data.tolist()) for t in second.outputs] == [("Y", [[30]]), ("Z", [[3]])]
    assert [t.name for t in subset.outputs] == ["Z"]
    assert other.outputs[0].data.tolist() == [[40]]
    s = runner.inference_statistics()
    assert s.response_cache
    assert s.success == DurationStat(4, 3 * 10 * MS)
    assert s.queue == DurationStat(4, 0)
    assert s.cache_hit == DurationStat(1, 0) and s.cache_miss == DurationStat(3, 0)
    assert (s.inference_count, s.execution_count) == (3, 3)
    assert s.compute_infer == DurationStat(3, 30 * MS)


async def test_failures_are_never_cached(autojump_clock):
    model = Timed(max_batch_size=1)
    runner = ModelRunner(model, "1", cache=ResponseCache(1 << 20))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        model.fail = True
        with pytest.raises(InternalError):
            await runner.infer(request(5))
        model.fail = False
        assert (await runner.infer(request(5))).outputs[0].data.tolist() == [[50]]
        assert (await runner.infer(request(5))).outputs[0].data.tolist() == [[50]]
        nursery.cancel_scope.cancel()
    assert model.executions == [[5], [5]]
    s = runner.inference_statistics()
    assert (s.cache_hit.count, s.cache_miss.count, s.fail.count) == (1, 1, 1)


async def test_pending_is_the_queue_depth(autojump_clock):
    runner = ModelRunner(Timed(max_batch_size=1), "1")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        for i in range(3):
            nursery.start_soon(runner.infer, request(i))
        await runner.wait_until(lambda load: load.executing == 1 and load.queued == 2)
        assert runner.inference_statistics().pending == 2
        await runner.wait_until(lambda load: load.queued == 0)
        assert runner.inference_statistics().pending == 0
        nursery.cancel_scope.cancel()


async def test_a_response_that_cannot_be_cached_is_answered_uncached(
    autojump_clock, monkeypatch, caplog
):
    """Caching copies the outputs (a device array cannot be copied so): a failing copy
    once ended the instance's task, and the server with it."""
    from trioserve.scheduler import _cache

    def faulty(array):
        raise TypeError("cannot copy this array")

    monkeypatch.setattr(_cache, "_frozen_copy", faulty)
    model = Timed(max_batch_size=1)
    runner = ModelRunner(model, "1", cache=ResponseCache(1 << 20))
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        assert (await runner.infer(request(5))).outputs[0].data.tolist() == [[50]]
        assert (await runner.infer(request(5))).outputs[0].data.tolist() == [[50]]
        nursery.cancel_scope.cancel()
    assert model.executions == [[5], [5]]  # nothing cached: both executed
    s = runner.inference_statistics()
    assert (s.success.count, s.cache_hit.count, s.fail.count) == (2, 0, 0)
    assert "could not be cached" in caplog.text
