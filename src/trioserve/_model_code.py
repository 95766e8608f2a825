"""What model code raises, told apart from the server's own cancellation.

Model code (a model.py's import, ``initialize``, ``execute``, ``finalize``, a ``Model``'s
``load``, ``execute``, ``unload``, a generative model's ``step`` and tokenizer) may raise
anything, ``BaseException``s included: ``sys.exit(5)``, ``raise KeyboardInterrupt``,
``GeneratorExit``, or argparse exiting 2 on arguments it does not know. None of these
may stop the server: each fails what the model was doing (its requests, its load, its
unload), as an ``Exception`` would, through ``ModelCodeExit``.

Two things are not the model's and propagate: ``trio.Cancelled`` (the server cancels a
load, an execution, a request) and a real Ctrl-C. trio delivers a Ctrl-C to the main
task, unless the signal lands in code that is not KI-protected, where it is raised on
the spot; so every place that calls model code on the event loop is KI-protected
(``trio.lowlevel.enable_ki_protection``): a Ctrl-C arriving while model code runs is
delivered to the main task at its next checkpoint, and a ``KeyboardInterrupt`` coming
out of model code is always the model's own. Code in a worker thread never receives
the signal (Python delivers it to the main thread), so what it raises is the model's too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import trio


class ModelCodeExit(Exception):
    """Model code raised a ``BaseException`` that is no ``Exception``; the message names
    the model, what it raised, and where: "model 'x' called sys.exit(5) in execute"."""


def model_failure(exc: BaseException, model: str, where: str) -> Exception:
    """What model code raised, as the ``Exception`` its caller fails the call with;
    ``where`` says in what ("in execute", "at import"). The server's own cancellation
    (``trio.Cancelled``, alone or in a group) is raised again instead."""
    if isinstance(exc, Exception):
        return exc
    if isinstance(exc, trio.Cancelled):
        raise exc
    if isinstance(exc, BaseExceptionGroup):
        cancelled = exc.subgroup(trio.Cancelled)
        if cancelled is not None:
            raise cancelled
    return ModelCodeExit(f"model '{model}' {raised(exc)} {where}")


def raise_failure(exc: BaseException, model: str, where: str) -> NoReturn:
    """Raise ``model_failure(exc, ...)``: ``exc`` itself when it is an ``Exception``."""
    failure = model_failure(exc, model, where)
    if failure is exc:
        raise exc
    raise failure from exc


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
        failure = model_failure(exc, model, "at import")
        raise error(f"{path}: failed to import: {failure_text(failure)}") from None
    return module


def failure_message(model: str, exc: Exception) -> str:
    """What a request that model code failed is answered: "model 'x' failed: <exc>", or
    the words of a ``ModelCodeExit``, which name the model already."""
    return str(exc) if isinstance(exc, ModelCodeExit) else f"model '{model}' failed: {exc}"
