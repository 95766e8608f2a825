"""Built-in example models: what ``trioserve run`` serves without a repository."""

from .._model import Model
from ._zoo import reference_zoo


def builtin_models() -> list[Model]:
    return reference_zoo()


__all__ = ["builtin_models", "reference_zoo"]
