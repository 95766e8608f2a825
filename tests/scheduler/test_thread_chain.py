"""A sync model's worker thread runs the batches prefetched while it works back to back,
and a full queue refuses before a request is decoded."""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from trioserve import (
    DynamicBatching,
    InferenceRequest,
    InputTensor,
    ServerConfig,
    TensorSpec,
    UnavailableError,
    model,
    open_server,
)
from trioserve._tensor import datatype
from trioserve.scheduler._runner import ModelRunner


class ThreadModel:
    """A sync model (so it runs in worker threads) whose first execution blocks until
    released; logs each execution's request values."""

    def __init__(self, max_batch_size: int = 0, **batching: Any) -> None:
        self.executions: list[list[int]] = []
        self.release = threading.Event()

        @model(
            name="threaded",
            inputs=[TensorSpec("X", "INT32", [1])],
            outputs=[TensorSpec("Y", "INT32", [1])],
            max_batch_size=max_batch_size,
            dynamic_batching=DynamicBatching(**batching),
        )
        def threaded(X):
            self.executions.append(X.reshape(-1).tolist())
            if len(self.executions) == 1:
                assert self.release.wait(30)
            return {"Y": X * 10}

        self.runner = ModelRunner(threaded, "1")


def request(i: int, rows: int = 0, **parameters: Any) -> InferenceRequest:
    shape = (rows, 1) if rows else (1,)
    data = np.full(shape, i, dtype=np.int32)
    tensor = InputTensor("X", datatype("INT32"), data.shape, data)
    return InferenceRequest("threaded", "", {"X": tensor}, parameters=parameters)


@pytest.fixture
def thread_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call into a worker thread the runner makes to execute (not load) the model."""
    calls: list[str] = []
    run_sync = trio.to_thread.run_sync

    async def counting(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if "execute" in fn.__name__:
            calls.append(fn.__name__)
        return await run_sync(fn, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting)
    return calls


async def _serve_three(subject: ThreadModel, rows: int = 0, **parameters: Any) -> list[int]:
    """Three requests: the first executes (blocked) while the other two wait."""
    runner = subject.runner
    answers: dict[int, int] = {}

    async def one(i: int) -> None:
        response = await runner.infer(request(i, rows, **parameters))
        answers[i] = int(response.outputs[0].data.reshape(-1)[0])

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            nursery.start_soon(one, 1)
            await runner.wait_until(lambda s: s.executing == 1)
            for i in (2, 3):
                nursery.start_soon(one, i)
                await runner.wait_until(lambda s, i=i: s.queued == i - 1)
            subject.release.set()
            await runner.wait_until(lambda s: not (s.queued or s.executing))
            nursery.cancel_scope.cancel()
    return [answers[i] for i in (1, 2, 3)]


async def test_batches_prefetched_while_the_thread_works_run_in_that_same_call(thread_calls):
    subject = ThreadModel()
    assert await _serve_three(subject) == [10, 20, 30]
    assert subject.executions == [[1], [2], [3]]
    assert thread_calls == ["execute_chain"]  # one trip to the thread for all three
    statistics = subject.runner.inference_statistics()
    assert (statistics.execution_count, statistics.success.count) == (3, 3)


async def test_requests_that_may_time_out_stay_in_the_queue(thread_calls):
    subject = ThreadModel()
    # A queue timeout is the batcher's to enforce: such requests are not prefetched.
    assert await _serve_three(subject, timeout=60_000_000) == [10, 20, 30]
    assert len(thread_calls) == 3


async def test_only_full_batches_are_prefetched(thread_calls):
    subject = ThreadModel(max_batch_size=4)
    # Two rows wait: a batch of up to four could still grow, so it waits for the thread
    # to come back and is then executed as one.
    assert await _serve_three(subject, rows=1) == [10, 20, 30]
    assert subject.executions == [[1], [2, 3]]
    assert len(thread_calls) == 2


async def test_a_full_queue_refuses_before_the_request_is_decoded() -> None:
    subject = ThreadModel(max_queue_size=1)
    runner = subject.runner
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            nursery.start_soon(runner.infer, request(1))
            await runner.wait_until(lambda s: s.executing == 1)
            for i in (2, 3, 4):  # two prefetched for the busy thread, one queued
                nursery.start_soon(runner.infer, request(i))
                await runner.wait_until(lambda s, i=i: s.queued == i - 1)
            with pytest.raises(UnavailableError, match="Exceeds maximum queue size"):
                runner.admit()
            failures = runner.inference_statistics().failures
            assert {reason.value: n for reason, n in failures.items() if n} == {"REJECTED": 1}
            subject.release.set()
            await runner.wait_until(lambda s: not (s.queued or s.executing))
            runner.admit()  # room again: no refusal
            nursery.cancel_scope.cancel()
    assert subject.executions == [[1], [2], [3], [4]]


async def test_over_http_a_full_queue_answers_503_without_reading_the_tensors() -> None:
    subject = ThreadModel(max_queue_size=1)
    config = ServerConfig(models=[subject.runner.model], http_port=0, grpc_port=None)
    body = {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [7]}]}
    with trio.fail_after(30):
        async with open_server(config) as server, httpx.AsyncClient() as client:
            runner = server.repository.get("threaded")
            url = f"http://127.0.0.1:{server.http_port}/v2/models/threaded/infer"
            async with trio.open_nursery() as nursery:
                for i in range(1, 5):  # executing, two prefetched, one queued
                    nursery.start_soon(partial(client.post, url, json=body))
                    await runner.wait_until(lambda s, i=i: s.queued + s.executing == i)
                # Not even JSON: decoding would answer 400, the full queue answers first.
                refused = await client.post(url, content=b'{"inputs": [')
                assert refused.status_code == 503
                assert refused.json() == {"error": "Exceeds maximum queue size"}
                subject.release.set()
            assert len(subject.executions) == 4
            await server.shutdown()
