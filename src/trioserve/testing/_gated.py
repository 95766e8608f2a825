"""A model whose executions wait at a gate, for tests of what happens meanwhile.

A test can hold requests in the model (cancel them, send more, unload, shut down, watch
the load report or the queue) and let them go when it chooses, with no sleeps.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from .._generative import GenerativeModel
from .._model import Model, Result
from .._types import InferenceRequest
from ._wrapped import WrappedModel


class GatedModel(WrappedModel):
    """``model`` as it is declared and computes, each execution first waiting until
    ``release`` is set. ``entered`` is set once an execution waits; ``waiting`` counts
    the executions waiting now. The computation runs after the gate."""

    def __init__(self, model: Model) -> None:
        if isinstance(model, GenerativeModel):
            raise TypeError("a generative model has steps, not executions, to hold")
        super().__init__(model)
        self.entered = trio.Event()
        self.release = trio.Event()
        self.waiting = 0

    async def execute(self, requests: Sequence[InferenceRequest]) -> Sequence[Result]:
        self.waiting += 1
        self.entered.set()
        try:
            await self.release.wait()
        finally:
            self.waiting -= 1
        return await self.compute(requests)


def gated(model: Model) -> GatedModel:
    """``model`` with every execution held until ``release`` is set; see ``GatedModel``."""
    return GatedModel(model)
