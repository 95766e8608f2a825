"""Importing model code, and what it raised in words; no trio here, so that an instance
process inspecting a model.py (``repository/_pb_inspect``) tells failures as the server
does (``_model_code`` adds the server's own cancellation to these)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


class ModelCodeExit(Exception):
    """Model code raised a ``BaseException`` that is no ``Exception``; the message names
    the model, what it raised, and where: "model 'x' called sys.exit(5) in execute"."""


def code_failure(exc: BaseException, model: str, where: str) -> Exception:
    """What model code raised, as the ``Exception`` its caller fails the call with:
    ``exc`` itself, or a ``ModelCodeExit`` naming the model, what it raised and ``where``
    ("in execute", "at import")."""
    if isinstance(exc, Exception):
        return exc
    return ModelCodeExit(f"model '{model}' {raised(exc)} {where}")


def raised(exc: BaseException) -> str:
    """``exc`` in words: "called sys.exit(5)", "raised KeyboardInterrupt",
    "raised GeneratorExit (its message)"."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({'' if exc.code is None else repr(exc.code)})"
    message = str(exc)
    return f"raised {type(exc).__name__}" + (f" ({message})" if message else "")


def failure_text(exc: Exception) -> str:
    """A failure as a load error tells it: the type and message of an ``Exception``, the
    words of a ``ModelCodeExit``."""
    return str(exc) if isinstance(exc, ModelCodeExit) else f"{type(exc).__name__}: {exc}"


def import_model_code(
    path: Path, module_name: str, model: str, error: type[Exception]
) -> ModuleType:
    """The model file ``path`` imported as ``module_name``, for model ``model``; what
    keeps it from being imported (its code failing, ``sys.exit`` and ``argparse``
    included) is raised as ``error``, whose message names the file."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise error(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:  # fails this load only
        failure = code_failure(exc, model, "at import")
        raise error(f"{path}: failed to import: {failure_text(failure)}") from None
    return module
