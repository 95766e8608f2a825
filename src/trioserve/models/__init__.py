"""Built-in example models: what ``trioserve run`` serves without a repository."""

from .._model import Model
from ._tiny_lm import TinyLM
from ._zoo import reference_zoo


def builtin_models() -> list[Model]:
    return [*reference_zoo(), TinyLM()]


__all__ = ["TinyLM", "builtin_models", "reference_zoo"]
