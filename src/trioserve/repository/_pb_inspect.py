"""What the server learns of a Python-backend model.py: that it defines a usable
``TritonPythonModel``, and the config its ``auto_complete_config`` completes.

In thread mode the server imports the file itself. In process mode it does not: a
process of the model's own (the stub, ``python -m trioserve.repository._pb_stub
inspect``, under the model's ``EXECUTION_ENV_PATH`` interpreter) imports it, runs the
hook on the config's JSON form and answers that form (``inspect_files``), so that a
model whose libraries only its own environment has, or whose import has side effects
(threads, a CUDA context, ``sys.exit``), loads as its instances will run it, and the
server never holds the model's module. Standard library only (and ``_auto_complete``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from .._model_import import code_failure, import_model_code
from . import _pb_utils as pb_utils
from ._auto_complete import ModelConfig
from ._pb_execution import MODULE_NAME

INSPECT = "inspect"  # the stub's argument that asks for an inspection


class ModelFileError(ValueError):
    """The model file cannot serve; the message names the file and why."""


def model_class(module: Any, path: Path) -> type:
    """The module's ``TritonPythonModel``, checked to have an ``execute``."""
    found = getattr(module, "TritonPythonModel", None)
    if not isinstance(found, type):
        raise ModelFileError(f"{path}: defines no class 'TritonPythonModel'")
    if not callable(getattr(found, "execute", None)):
        raise ModelFileError(f"{path}: TritonPythonModel has no 'execute' method")
    return found


def import_model_class(path: Path, module_name: str, model: str) -> type:
    """Import a model.py and return its ``TritonPythonModel`` class."""
    # Models import the utilities by Triton's name; ours stands in for it.
    sys.modules.setdefault(MODULE_NAME, pb_utils)
    return model_class(import_model_code(path, module_name, model, ModelFileError), path)


def auto_complete(found: type, document: dict[str, Any], path: Path, model: str) -> None:
    """Let the class's ``auto_complete_config`` complete ``document`` (the config's JSON
    form, changed in place), as Triton does when the config is not strict."""
    hook = getattr(found, "auto_complete_config", None)
    if hook is None:
        return
    try:
        returned = hook(ModelConfig(document))
    except BaseException as exc:  # fails this load only
        failure = code_failure(exc, model, "in auto_complete_config")
        raise ModelFileError(f"{path}: auto_complete_config failed: {failure}") from None
    if not isinstance(returned, ModelConfig):
        raise ModelFileError(f"{path}: auto_complete_config must return the config it received")


def inspect_files(asked: TextIO, answer: TextIO) -> None:
    """In the model's process: read what to inspect (JSON: the model's name, its files
    as (path, module name), the config's form to complete with the last, or null, and
    the config file's path),
    answer the completed form (or null), or the error that keeps the model from
    loading."""
    request = json.load(asked)
    document = request["config"]
    try:
        files = [(Path(path), module_name) for path, module_name in request["files"]]
        classes = [import_model_class(*file, request["model"]) for file in files]
        if document is not None:  # the latest version's class completes it
            path = Path(request["config_file"])  # named in its errors, as in thread mode
            auto_complete(classes[-1], document, path, request["model"])
        reply: dict[str, Any] = {"config": document}
    except ModelFileError as exc:
        reply = {"error": str(exc)}
    json.dump(reply, answer)
    answer.flush()


def answer_channel() -> TextIO:
    """Where the answer goes: the process's stdout, which from now on is its stderr
    (what the model prints there reaches the server's log, not the answer)."""
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return channel
