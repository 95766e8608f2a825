"""A decoupled model on the runner under trio's MockClock: answers as they are sent,
the outcome once both the final flag and the execution are done, withdrawals."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import trio

from trioserve import InferenceRequest, InputTensor, Model, SequenceBatching, TensorSpec
from trioserve._tensor import datatype
from trioserve.scheduler._decoupled_runner import DecoupledRunner


class Counter(Model):
    """Answers I = 0 .. N-1, one every 10 ms, then the final flag alone; N < 0 fails.
    ``stopped`` records the requests that saw their client give up."""

    def __init__(self) -> None:
        super().__init__(
            name="counter",
            inputs=[TensorSpec("N", "INT32", [1])],
            outputs=[TensorSpec("I", "INT32", [1])],
            decoupled=True,
        )
        self.stopped: list[float] = []

    async def execute(self, requests: Sequence[InferenceRequest]) -> None:
        for request in requests:
            sender = request.response_sender
            assert sender is not None
            count = int(request.inputs["N"].data[0])
            if count < 0:
                raise ValueError("negative count")
            for i in range(count):
                await trio.sleep(0.010)
                if sender.cancelled:
                    self.stopped.append(trio.current_time())
                    break
                sender.send({"I": np.array([i], np.int32)})
            sender.send(final=True)


def request(count: int) -> InferenceRequest:
    data = np.array([count], np.int32)
    return InferenceRequest("counter", "", {"N": InputTensor("N", datatype("INT32"), (1,), data)})


async def collect(ticket: Any) -> list[tuple[float, Any, bool]]:
    answers = []
    async for answer, final in ticket.answers():
        value = (
            answer
            if answer is None or isinstance(answer, Exception)
            else int(answer.outputs[0].data[0])
        )
        answers.append((round(trio.current_time(), 6), value, final))
    return answers


async def test_answers_arrive_as_they_are_sent(autojump_clock: Any) -> None:
    runner = DecoupledRunner(Counter(), "1")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        ticket = runner.submit(request(3))
        assert await collect(ticket) == [
            (0.01, 0, False),
            (0.02, 1, False),
            (0.03, 2, False),
            (0.03, None, True),
        ]
        await ticket.wait()
        assert ticket.outcome().outputs == []
        stats = runner.inference_statistics()
        assert (stats.success.count, stats.execution_count, stats.success.ns) == (
            1,
            1,
            30_000_000,
        )
        nursery.cancel_scope.cancel()


async def test_a_withdrawn_request_drops_later_answers(autojump_clock: Any) -> None:
    model = Counter()
    runner = DecoupledRunner(model, "1")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        ticket = runner.submit(request(5))
        answers = ticket.answers()
        assert (await answers.receive())[1] is False
        ticket.withdraw()
        received = await collect(ticket)
        assert len(received) == 1 and "cancelled" in str(received[0][1])
        await runner.wait_until(lambda s: s.executing == 0)
        assert model.stopped == [0.02]  # it saw the cancellation at its next send
        stats = runner.inference_statistics()
        assert (stats.success.count, stats.fail.count) == (0, 1)
        nursery.cancel_scope.cancel()


async def test_a_failed_execution_ends_the_answers_with_its_error(autojump_clock: Any) -> None:
    runner = DecoupledRunner(Counter(), "1")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        ticket = runner.submit(request(-1))
        [(_, error, final)] = await collect(ticket)
        assert final and "negative count" in str(error)
        nursery.cancel_scope.cancel()


def test_what_a_decoupled_model_cannot_use() -> None:
    spec = [TensorSpec("N", "INT32", [1])]
    for settings in ({"response_cache": True}, {"sequence_batching": SequenceBatching()}):
        with pytest.raises(ValueError, match="a decoupled model cannot use"):
            Model(name="m", inputs=spec, outputs=[], decoupled=True, **settings)  # type: ignore[arg-type]
