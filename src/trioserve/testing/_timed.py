"""A model whose executions take a declared time, so that batching comes out exact.

The server runs a plain ``execute`` (and ``load``, ``unload``) in a worker thread, and a
mock clock does not wait for threads: it may jump while the model computes.
``TimedModel`` calls the model's own methods in trio instead (the computation takes no
time on the clock) and then sleeps the declared cost with ``trio.sleep``, which the mock
clock jumps over exactly.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from .._generative import GenerativeModel
from .._model import Model, Result, batch_size
from .._stats import MemoryUsage
from .._types import InferenceRequest

Cost = float | Callable[[int], float]
"""Seconds an execution takes: a constant, or a function of the batch size."""


@dataclass(frozen=True, slots=True)
class ExecutedBatch:
    """One execution of a timed model: when it ran, in ``trio.current_time()`` seconds,
    and the batch size and id of each request it held."""

    started: float
    finished: float
    request_sizes: tuple[int, ...]
    request_ids: tuple[str, ...]

    @property
    def batch_size(self) -> int:
        """The batch elements executed (for a model that does not batch, requests)."""
        return sum(self.request_sizes)


class TimedModel(Model):
    """``model`` as it is declared and computes, each execution taking ``cost`` seconds.

    ``executions`` records every execution in order.
    """

    def __init__(self, model: Model, cost: Cost) -> None:
        if isinstance(model, GenerativeModel):
            raise TypeError("a generative model's time is its steps': see TimedLM")
        declared = {f.name: getattr(model, f.name) for f in dataclasses.fields(Model)}
        super().__init__(**declared)
        self.model = model
        self.cost: Callable[[int], float] = cost if callable(cost) else _constant(cost)
        self.executions: list[ExecutedBatch] = []

    @property
    def batch_sizes(self) -> list[int]:
        """The batch size of each execution so far, in order."""
        return [execution.batch_size for execution in self.executions]

    # The hooks run in trio too: a worker thread would let the mock clock jump.
    async def load(self) -> None:
        await _in_trio(self.model.load)

    async def unload(self) -> None:
        await _in_trio(self.model.unload)

    def memory_usage(self) -> Sequence[MemoryUsage]:
        return self.model.memory_usage()

    def described_config(self) -> Mapping[str, Any] | None:
        return self.model.described_config()

    async def execute(self, requests: Sequence[InferenceRequest]) -> Sequence[Result]:
        started = trio.current_time()
        sizes = tuple(batch_size(r) if self.batches else 1 for r in requests)
        seconds = self.cost(sum(sizes))
        if seconds < 0:
            raise ValueError(f"the cost of a batch of {sum(sizes)} is negative: {seconds}")
        results: Sequence[Result] = await _in_trio(self.model.execute, requests)
        await trio.sleep(seconds)
        ids = tuple(r.id for r in requests)
        self.executions.append(ExecutedBatch(started, trio.current_time(), sizes, ids))
        return results


def timed(model: Model, cost: Cost) -> TimedModel:
    """``model`` with every execution taking ``cost`` seconds (a constant, or a
    function of the batch size) on trio's clock; see ``TimedModel``."""
    return TimedModel(model, cost)


async def _in_trio(function: Callable[..., Any], *args: Any) -> Any:
    """Call a model's method in trio, sync or async."""
    result = function(*args)
    return await result if inspect.isawaitable(result) else result


def _constant(seconds: float) -> Callable[[int], float]:
    if seconds < 0:
        raise ValueError("an execution cannot take negative time")
    return lambda _: seconds
