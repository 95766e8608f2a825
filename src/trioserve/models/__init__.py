"""Built-in example models: what ``trioserve run`` serves without a repository."""

from pathlib import Path

from .._model import Model
from ._checkpoint import CheckpointLM, load_checkpoint_model
from ._llama import CheckpointError
from ._tiny_lm import TinyLM
from ._zoo import reference_zoo

# Triton's standard example models, as a Triton model repository (Python backend).
TRITON_EXAMPLES = Path(__file__).parent / "triton"


def builtin_models() -> list[Model]:
    return [*reference_zoo(), TinyLM()]


__all__ = [
    "TRITON_EXAMPLES",
    "CheckpointError",
    "CheckpointLM",
    "TinyLM",
    "builtin_models",
    "load_checkpoint_model",
    "reference_zoo",
]
