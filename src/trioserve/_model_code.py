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

from typing import NoReturn

import trio

from ._model_import import ModelCodeExit, code_failure


def model_failure(exc: BaseException, model: str, where: str) -> Exception:
    """What model code raised, as the ``Exception`` its caller fails the call with;
    ``where`` says in what ("in execute", "at import"). The server's own cancellation
    (``trio.Cancelled``, alone or in a group) is raised again instead."""
    if isinstance(exc, trio.Cancelled):
        raise exc
    if isinstance(exc, BaseExceptionGroup):
        cancelled = exc.subgroup(trio.Cancelled)
        if cancelled is not None:
            raise cancelled
    return code_failure(exc, model, where)


def raise_failure(exc: BaseException, model: str, where: str) -> NoReturn:
    """Raise ``model_failure(exc, ...)``: ``exc`` itself when it is an ``Exception``."""
    failure = model_failure(exc, model, where)
    if failure is exc:
        raise exc
    raise failure from exc


def failure_message(model: str, exc: Exception) -> str:
    """What a request that model code failed is answered: "model 'x' failed: <exc>", or
    the words of a ``ModelCodeExit``, which name the model already."""
    return str(exc) if isinstance(exc, ModelCodeExit) else f"model '{model}' failed: {exc}"
