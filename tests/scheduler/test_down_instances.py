"""A model instance that is down (``Model.instance_down``: a process restarting, or given
up on) gets no batches while another instance can run them, under trio's MockClock:
exact instances and times."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import trio

from trioserve import InferenceRequest, InputTensor, Model, SequenceBatching, TensorSpec
from trioserve._errors import UnavailableError
from trioserve._model import MODEL_INSTANCE
from trioserve._tensor import datatype
from trioserve.scheduler._runner import ModelRunner
from trioserve.scheduler._sequence_runner import SequenceRunner

COMPUTE_S = 0.010


class TwoInstances(Model):
    """Answers Y = the instance that ran it; ``down`` holds the instances that are down,
    each with the event that ends it."""

    def __init__(self, count: int = 2, sequences: SequenceBatching | None = None) -> None:
        super().__init__(
            name="two",
            inputs=[TensorSpec("X", "INT32", [1])],
            outputs=[TensorSpec("Y", "INT32", [1])],
            instance_count=count,
            sequence_batching=sequences,
        )
        self.down: dict[int, trio.Event] = {}
        self.ran: list[tuple[float, int]] = []

    def instance_down(self, index: int) -> Callable[[], Awaitable[None]] | None:
        event = self.down.get(index)
        return None if event is None or event.is_set() else event.wait

    async def execute(self, requests: Sequence[InferenceRequest]) -> list[Any]:
        instance = MODEL_INSTANCE.get()
        self.ran.append((round(trio.current_time(), 6), instance))
        await trio.sleep(COMPUTE_S)
        if instance in self.down and not self.down[instance].is_set():
            raise UnavailableError(f"model 'two' is unavailable: instance {instance} is down")
        return [{"Y": np.array([instance], np.int32)} for _ in requests]


def request(**parameters: Any) -> InferenceRequest:
    data = np.zeros(1, np.int32)
    tensor = InputTensor("X", datatype("INT32"), (1,), data)
    return InferenceRequest("two", "", {"X": tensor}, parameters=parameters)


async def ask(runner: ModelRunner, count: int) -> list[Any]:
    """``count`` requests at once: (time answered, instance or error) of each, sorted."""
    results: list[Any] = [None] * count

    async def one(index: int) -> None:
        ticket = runner.submit(request())
        await ticket.wait()
        try:
            outcome: Any = int(ticket.outcome().outputs[0].data[0])
        except Exception as exc:
            outcome = str(exc)
        results[index] = (round(trio.current_time(), 6), outcome)

    async with trio.open_nursery() as nursery:
        for index in range(count):
            nursery.start_soon(one, index)
    return sorted(results)


async def test_a_down_instance_passes_its_batches_on(autojump_clock: Any) -> None:
    model = TwoInstances()
    runner = ModelRunner(model, "1")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        assert await ask(runner, 2) == [(0.01, 0), (0.01, 1)]
        model.down[1] = trio.Event()
        # Instance 1 learns it is down when handed a batch, and hands it on: instance 0
        # runs all four, one after another.
        assert await ask(runner, 4) == [(0.02, 0), (0.03, 0), (0.04, 0), (0.05, 0)]
        assert runner.statistics().executing == 0
        model.down[1].set()  # started again: it takes batches again
        await trio.testing.wait_all_tasks_blocked()
        assert await ask(runner, 2) == [(0.06, 0), (0.06, 1)]
        nursery.cancel_scope.cancel()
    assert [instance for _, instance in model.ran].count(1) == 2
    assert runner.inference_statistics().fail.count == 0


async def test_with_every_instance_down_a_batch_runs_and_fails(autojump_clock: Any) -> None:
    model = TwoInstances()
    runner = ModelRunner(model, "1")
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        model.down[0] = trio.Event()
        model.down[1] = trio.Event()
        # The first instance handed a batch passes it on; the other, last one up, runs
        # it (a process model would wait for its restart, or fail at once).
        [(at, outcome)] = await ask(runner, 1)
        assert at == 0.01 and "is down" in outcome
        nursery.cancel_scope.cancel()


async def test_a_sequence_stays_on_its_instance_and_new_ones_avoid_it(
    autojump_clock: Any,
) -> None:
    model = TwoInstances(sequences=SequenceBatching())  # direct: one slot per instance
    runner = SequenceRunner(model, "1")

    async def send(corrid: int, start: bool = False, end: bool = False) -> Any:
        flags = {"sequence_start": start, "sequence_end": end}
        ticket = runner.submit(request(sequence_id=corrid, **flags))
        await ticket.wait()
        try:
            return int(ticket.outcome().outputs[0].data[0])
        except Exception as exc:
            return str(exc)

    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        assert [await send(1, start=True), await send(2, start=True)] == [0, 1]
        model.down[1] = trio.Event()
        # Sequence 2 keeps its instance: its last request fails naming it, as Triton's
        # would with that instance's backend gone (Triton moves no sequence either).
        assert await send(2, end=True) == "model 'two' is unavailable: instance 1 is down"
        # A new sequence takes no slot of the down instance (free since 30 ms): it waits
        # for sequence 1's, freed when that sequence has been idle 1 s (from 10 ms).
        assert await send(3, start=True) == 0
        assert round(trio.current_time(), 6) == 1.01 + 0.01
        nursery.cancel_scope.cancel()
