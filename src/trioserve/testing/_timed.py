"""A model whose executions take a declared time, so that batching comes out exact.

``TimedModel`` computes in trio (``WrappedModel``: the computation takes no time on the
clock) and then sleeps the declared cost with ``trio.sleep``, which the mock clock jumps
over exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from .._generative import GenerativeModel
from .._model import Model, Result, batch_size
from .._types import InferenceRequest
from ._wrapped import WrappedModel

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


class TimedModel(WrappedModel):
    """``model`` as it is declared and computes, each execution taking ``cost`` seconds.

    ``executions`` records every execution in order.
    """

    def __init__(self, model: Model, cost: Cost) -> None:
        if isinstance(model, GenerativeModel):
            raise TypeError("a generative model's time is its steps': see TimedLM")
        super().__init__(model)
        self.cost: Callable[[int], float] = cost if callable(cost) else _constant(cost)
        self.executions: list[ExecutedBatch] = []

    @property
    def batch_sizes(self) -> list[int]:
        """The batch size of each execution so far, in order."""
        return [execution.batch_size for execution in self.executions]

    async def execute(self, requests: Sequence[InferenceRequest]) -> Sequence[Result]:
        started = trio.current_time()
        sizes = tuple(batch_size(r) if self.batches else 1 for r in requests)
        seconds = self.cost(sum(sizes))
        if seconds < 0:
            raise ValueError(f"the cost of a batch of {sum(sizes)} is negative: {seconds}")
        results = await self.compute(requests)
        await trio.sleep(seconds)
        ids = tuple(r.id for r in requests)
        self.executions.append(ExecutedBatch(started, trio.current_time(), sizes, ids))
        return results


def timed(model: Model, cost: Cost) -> TimedModel:
    """``model`` with every execution taking ``cost`` seconds (a constant, or a
    function of the batch size) on trio's clock; see ``TimedModel``."""
    return TimedModel(model, cost)


def _constant(seconds: float) -> Callable[[int], float]:
    if seconds < 0:
        raise ValueError("an execution cannot take negative time")
    return lambda _: seconds
