"""The base of the testing wrappers: a model as it is declared, its methods run in trio.

The server runs a plain ``execute`` (and ``load``, ``unload``) in a worker thread, and a
mock clock does not wait for threads: it may jump while the model computes. A wrapper
calls the model's own methods in trio instead, so that what it adds (a declared time, a
gate) is all that happens on trio's clock.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._model import Model, Result
from .._stats import MemoryUsage
from .._types import InferenceRequest


class WrappedModel(Model):
    """``model``'s declaration, hooks and computation, called in trio."""

    def __init__(self, model: Model) -> None:
        declared = {f.name: getattr(model, f.name) for f in dataclasses.fields(Model)}
        super().__init__(**declared)
        self.model = model

    async def load(self) -> None:
        await _in_trio(self.model.load)

    async def unload(self) -> None:
        await _in_trio(self.model.unload)

    def memory_usage(self) -> Sequence[MemoryUsage]:
        return self.model.memory_usage()

    def described_config(self) -> Mapping[str, Any] | None:
        return self.model.described_config()

    async def compute(self, requests: Sequence[InferenceRequest]) -> Sequence[Result]:
        """The wrapped model's results for ``requests``."""
        results: Sequence[Result] = await _in_trio(self.model.execute, requests)
        return results


async def _in_trio(function: Callable[..., Any], *args: Any) -> Any:
    """Call a model's method in trio, sync or async."""
    result = function(*args)
    return await result if inspect.isawaitable(result) else result
