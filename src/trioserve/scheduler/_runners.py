"""Which runner serves a tensor model: the scheduler its configuration asks for."""

from __future__ import annotations

from .._model import Model
from ._decoupled_runner import DecoupledRunner
from ._runner import ModelRunner
from ._sequence_runner import DecoupledSequenceRunner, SequenceRunner


def runner_class(model: Model) -> type[ModelRunner]:
    """The sequence batcher (a decoupled model's iterative sequences too), the decoupled
    runner, or the dynamic batcher (with or without batching)."""
    if model.sequence_batching is not None:
        return DecoupledSequenceRunner if model.decoupled else SequenceRunner
    if model.decoupled:
        return DecoupledRunner
    return ModelRunner
