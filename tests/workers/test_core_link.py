"""The core's end of a worker's link, spoken to in process by a test playing the worker
(real socket pair, real frames): forwarded inferences and their withdrawal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio

import trioserve
from trioserve import DynamicBatching, Model, TensorSpec
from trioserve._server import Server
from trioserve.ipc import TrioChannel, channel_pair, encode_frames
from trioserve.testing import open_test_server
from trioserve.workers._core_link import WorkerLink
from trioserve.workers._wire import ANSWER, CANCEL, INFER, OUTCOME


class Gate:
    """A model whose executions wait until the test releases them; records its batches."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.release = trio.Event()
        self.batches: list[list[float]] = []

    def model(self) -> Model:
        @trioserve.model(
            name="gated",
            inputs=[TensorSpec("INPUT0", "FP32", [1])],
            outputs=[TensorSpec("OUTPUT0", "FP32", [1])],
            max_batch_size=8,
            dynamic_batching=DynamicBatching(),
        )
        async def gated(INPUT0: np.ndarray[Any, Any]) -> dict[str, Any]:
            self.batches.append(INPUT0.reshape(-1).tolist())
            self.entered.set()
            await self.release.wait()
            return {"OUTPUT0": INPUT0}

        return gated


class Worker:
    """The worker's end of a link served by a ``WorkerLink``."""

    def __init__(self, socket: trio.socket.SocketType) -> None:
        self.socket = socket
        self.channel = TrioChannel(socket)

    async def send_together(self, *messages: tuple[Any, ...]) -> None:
        """``messages`` in one write: the core reads them all at once."""
        data, _ = encode_frames((message, []) for message in messages)
        assert await self.socket.send(data) == len(data)

    async def infer(self, call: int, value: float) -> None:
        await self.channel.send(_infer(call, value))

    async def answers(self) -> list[tuple[int, float]]:
        """The next answers to come: (call, OUTPUT0) each."""
        answers = []
        for message, _ in await self.channel.receive():
            assert message[0] == ANSWER
            _, call, item, last = message
            assert item[0] == OUTCOME and item[1] is None and last
            (_, _, _, data, _), *_ = item[6]
            answers.append((call, float(np.frombuffer(data, np.float32)[0])))
        return answers


def _infer(call: int, value: float) -> tuple[Any, ...]:
    data = np.array([[value]], np.float32).tobytes()
    inputs = [("INPUT0", "FP32", (1, 1), data, {})]
    return (INFER, call, "HTTP end point", "gated", "", "", {}, inputs, [], None, None)


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
async def server(gate: Gate) -> AsyncIterator[Server]:
    async with open_test_server([gate.model()]) as server:
        yield server


@pytest.fixture
async def worker(server: Server, nursery: trio.Nursery) -> AsyncIterator[Worker]:
    core_end, worker_end = (trio.socket.from_stdlib_socket(end) for end in channel_pair())
    assert server.context is not None
    link = WorkerLink(TrioChannel(core_end), server.context, server.rest_app, {})
    nursery.start_soon(link.serve, [])
    worker = Worker(worker_end)
    try:
        yield worker
    finally:
        worker.channel.close()


async def _queued(server: Server, count: int) -> None:
    await server.repository.get("gated").wait_until(lambda stats: stats.queued == count)  # type: ignore[attr-defined]


async def test_a_cancel_withdraws_a_queued_inference(
    autojump_clock: trio.abc.Clock, server: Server, gate: Gate, worker: Worker
) -> None:
    await worker.infer(-1, 1.0)
    await gate.entered.wait()  # the one instance is busy until release
    await worker.infer(-2, 2.0)
    await _queued(server, 1)
    await worker.channel.send((CANCEL, -2))
    await _queued(server, 0)  # withdrawn
    gate.release.set()
    assert await worker.answers() == [(-1, 1.0)]
    await worker.infer(-3, 3.0)
    assert await worker.answers() == [(-3, 3.0)]  # the withdrawn one is never answered
    assert gate.batches == [[1.0], [3.0]]  # and never ran


async def test_a_cancel_that_overtakes_its_inference_withdraws_it_on_submission(
    autojump_clock: trio.abc.Clock, server: Server, gate: Gate, worker: Worker
) -> None:
    gate.release.set()
    # Read together: the CANCEL is handled before the call's task runs.
    await worker.send_together(_infer(-1, 1.0), (CANCEL, -1))
    await worker.infer(-2, 2.0)
    assert await worker.answers() == [(-2, 2.0)]
    assert gate.batches == [[2.0]]
