"""Iterative sequences (``sequence_batching { iterative_sequence: true }``) under trio's
MockClock: a request the model reschedules runs again in a later batch, on the same
instance, beside newer requests; exact batches, times and statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import trio
from google.protobuf import text_format

from trioserve import (
    InferenceRequest,
    InputTensor,
    Model,
    SequenceBatching,
    SequenceControl,
    SequenceState,
    TensorSpec,
)
from trioserve._tensor import datatype
from trioserve.repository._generated.model_config_pb2 import ModelConfig
from trioserve.repository._sequence_config import complete_sequence_batching, sequence_settings
from trioserve.scheduler._runners import runner_class
from trioserve.scheduler._sequence_runner import DecoupledSequenceRunner, SequenceRunner

COMPUTE_S = 0.010


class Steps(Model):
    """A request asking for N steps runs N executions: each step logs (correlation id,
    START, steps left) and reschedules it, the last one answers DONE = N (a decoupled
    one sends LEFT at every step, then the final flag)."""

    def __init__(self, *, decoupled: bool = False, max_batch_size: int = 2) -> None:
        super().__init__(
            name="steps",
            inputs=[TensorSpec("N", "INT32", [1])],
            outputs=[TensorSpec("DONE", "INT32", [1]), TensorSpec("LEFT", "INT32", [1])],
            max_batch_size=max_batch_size,
            decoupled=decoupled,
            sequence_batching=SequenceBatching(
                iterative_sequence=True,
                controls=[SequenceControl("START", "START", "INT32", (0, 1))],
            ),
        )
        self.executions: list[tuple[float, list[tuple[int, int, int]]]] = []
        self._left: dict[int, int] = {}
        self.cancelled_seen: list[int] = []

    async def execute(self, requests: Sequence[InferenceRequest]) -> list[Any]:
        steps = []
        results: list[Any] = []
        for request in requests:
            corrid = request.parameters["sequence_id"]
            start = int(request.inputs["START"].data.reshape(-1)[0])
            total = int(request.inputs["N"].data.reshape(-1)[0])
            if start:
                self._left[corrid] = total
            self._left[corrid] -= 1
            left = self._left[corrid]
            steps.append((corrid, start, left))
            sender = request.response_sender
            if sender is not None and sender.cancelled:
                self.cancelled_seen.append(corrid)
            request.rescheduled = left > 0
            row = {"DONE": np.array([[total]], np.int32), "LEFT": np.array([[left]], np.int32)}
            if sender is not None:
                sender.send(row, final=left == 0)
            results.append({} if left else row)
        self.executions.append((round(trio.current_time(), 6), steps))
        await trio.sleep(COMPUTE_S)
        return results


def request(steps: int, **parameters: Any) -> InferenceRequest:
    data = np.full((1, 1), steps, np.int32)
    tensor = InputTensor("N", datatype("INT32"), data.shape, data)
    return InferenceRequest("steps", "", {"N": tensor}, parameters=dict(parameters))


async def test_a_rescheduled_request_runs_again_beside_newer_ones(autojump_clock: Any) -> None:
    model = Steps()
    runner = runner_class(model)(model, "1")
    assert type(runner) is SequenceRunner
    finished: dict[str, tuple[float, int]] = {}

    async def wait(name: str, ticket: Any) -> None:
        await ticket.wait()
        done = int(ticket.outcome().as_numpy("DONE")[0][0])
        finished[name] = (round(trio.current_time(), 6), done)

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        tickets = {name: runner.submit(request(n)) for name, n in (("A", 3), ("B", 1), ("C", 2))}
        async with trio.open_nursery() as clients:
            for name, ticket in tickets.items():
                clients.start_soon(wait, name, ticket)
        nursery.cancel_scope.cancel()
    # Two slots (max_batch_size 2, one instance): C waits for B's to free. A and C are
    # rescheduled after each step and go first, being older than anything new.
    assert model.executions == [
        (0.0, [(1, 1, 2), (2, 1, 0)]),
        (0.01, [(1, 0, 1), (3, 1, 1)]),
        (0.02, [(1, 0, 0), (3, 0, 0)]),
    ]
    assert finished == {"A": (0.03, 3), "B": (0.01, 1), "C": (0.03, 2)}
    stats = runner.inference_statistics()
    # Every execution counts; a request counts once, when released, its duration from
    # its arrival to its final response.
    assert (stats.execution_count, stats.inference_count) == (3, 3)
    assert (stats.success.count, stats.success.ns) == (3, (30 + 10 + 30) * 1_000_000)


async def test_a_decoupled_request_answers_at_every_step(autojump_clock: Any) -> None:
    model = Steps(decoupled=True, max_batch_size=1)
    runner = runner_class(model)(model, "1")
    assert type(runner) is DecoupledSequenceRunner
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        ticket = runner.submit(request(3, sequence_id=42, sequence_start=True))
        answers = []
        async for answer, final in ticket.answers():
            left = None if answer is None else int(answer.as_numpy("LEFT")[0][0])
            answers.append((round(trio.current_time(), 6), left, final))
        await ticket.wait()
        nursery.cancel_scope.cancel()
    # The client's own correlation id is kept; only the first execution has START.
    assert model.executions == [(0.0, [(42, 1, 2)]), (0.01, [(42, 0, 1)]), (0.02, [(42, 0, 0)])]
    assert answers == [(0.0, 2, False), (0.01, 1, False), (0.02, 0, True)]
    stats = runner.inference_statistics()
    assert (stats.execution_count, stats.success.count) == (3, 1)


@pytest.mark.parametrize("decoupled", [False, True])
async def test_a_client_leaving_ends_its_rescheduled_request(
    autojump_clock: Any, decoupled: bool
) -> None:
    model = Steps(decoupled=decoupled, max_batch_size=1)
    runner = runner_class(model)(model, "1")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        ticket = runner.submit(request(100))
        await trio.sleep(0.025)  # its third step runs
        ticket.withdraw()
        await runner.wait_until(lambda s: not (s.executing or s.queued))
        later = runner.submit(request(1))
        await later.wait()
        nursery.cancel_scope.cancel()
    # No step after the one running when it left; the next request has the instance.
    assert [e[1][0][0] for e in model.executions] == [1, 1, 1, 2]
    assert ticket.withdrawn
    stats = runner.inference_statistics()
    assert (stats.success.count, stats.fail.count) == (1, 1)


def test_which_configurations_take_iterative_sequences() -> None:
    spec: dict[str, Any] = {
        "name": "m",
        "inputs": [TensorSpec("N", "INT32", [1])],
        "outputs": [TensorSpec("DONE", "INT32", [1])],
        "decoupled": True,
    }
    with pytest.raises(ValueError, match=r"the sequence batcher \(but for iterative sequences\)"):
        Model(**spec, sequence_batching=SequenceBatching())
    state = SequenceState("S_IN", "S_OUT", "INT32", [1])
    with pytest.raises(ValueError, match="implicit state"):
        Model(**spec, sequence_batching=SequenceBatching(iterative_sequence=True, states=[state]))
    iterative = Model(**spec, sequence_batching=SequenceBatching(iterative_sequence=True))
    assert runner_class(iterative) is DecoupledSequenceRunner
    # config.pbtxt's field, read as Triton's model_config.proto has it.
    config = text_format.Parse("sequence_batching { iterative_sequence: true }", ModelConfig())
    complete_sequence_batching(config)
    assert sequence_settings(config).iterative_sequence
