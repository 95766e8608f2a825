"""Calling a ``TritonPythonModel`` as Triton's stub does, wherever it runs: in a worker
thread of the server (thread mode, ``_python_backend``) or in its instance process
(``_pb_stub``). Only the standard library and ``pb_utils`` here: instance processes
import it.

``execute`` is called with the batch's requests; an ``async`` one runs on the
instance's asyncio loop (``_pb_loop``), the caller waiting for it, except a decoupled
model's, which runs on while the instance takes its next batch (Triton's behaviour).
What it returns is checked as Triton checks it; an exception is told as Triton's stub
tells it: its type, message, then the model's frames, innermost first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any

from .._errors import InternalError
from . import _pb_utils as pb_utils
from ._pb_loop import InstanceLoop

MODULE_NAME = "triton_python_backend_utils"
# Frames of these folders are the server's, not the model's: a traceback leaves them out.
_SERVER_FILES = (
    str(Path(__file__).parents[1]),
    str(Path(inspect.getfile(Future)).parents[2] / "asyncio"),
    str(Path(inspect.getfile(Future)).parents[1]),
)


def import_model_module(path: Path, module_name: str) -> ModuleType:
    """Import a model.py under ``module_name``; what its import raises goes through."""
    # Models import the utilities by Triton's name; ours stands in for it.
    sys.modules.setdefault(MODULE_NAME, pb_utils)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_hook(loop: InstanceLoop, hook: Callable[..., Any] | None, *args: Any) -> None:
    """Call ``initialize`` or ``finalize``; an ``async`` one runs on the instance's loop."""
    if hook is not None:
        returned = hook(*args)
        if inspect.isawaitable(returned):
            loop.run(_coroutine(returned))


def run_execute(
    model: Any,
    loop: InstanceLoop,
    served: list[pb_utils.InferenceRequest],
    decoupled: bool,
    failed: Callable[[BaseException], None],
) -> Any:
    """The model's ``execute(served)``: what it returned (a decoupled ``async`` one runs
    on, and ``failed`` gets what it raises)."""
    responses = model.execute(served)
    if inspect.isawaitable(responses):
        if decoupled:  # runs on; the instance takes its next batch

            def ended(future: Future[Any]) -> None:
                exc = None if future.cancelled() else future.exception()
                if exc is not None:
                    failed(exc)

            loop.submit(_coroutine(responses)).add_done_callback(ended)
            return None
        responses = loop.run(_coroutine(responses))
    return responses


_RESPONSE = pb_utils.InferenceResponse
_RELEASE_ALL = pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL


def checked_responses(
    model_name: str,
    decoupled: bool,
    iterative: bool,
    served: list[pb_utils.InferenceRequest],
    responses: Any,
) -> list[pb_utils.InferenceResponse | None]:
    """What ``execute`` returned for the ``served`` requests, checked as Triton checks it:
    one response per request, None for a request the model rescheduled. A decoupled
    model answers through its senders: its list is empty unless it rescheduled some
    (then an empty response stands for each of the others)."""
    count = len(served)
    if not iterative:
        for request in served:
            if request._release_flags != _RELEASE_ALL:
                _refuse_rescheduling(model_name, decoupled, request)
    if decoupled:
        if responses is not None:
            raise InternalError(
                f"model '{model_name}' is decoupled: execute must return None and answer "
                "through each request's response sender"
            )
        again = [r._rescheduled() for r in served]
        return [None if a else pb_utils.InferenceResponse() for a in again] if any(again) else []
    if not isinstance(responses, list | tuple) or len(responses) != count:
        got = len(responses) if isinstance(responses, list | tuple) else "no list of"
        raise InternalError(
            f"model '{model_name}': execute returned {got} responses for {count} requests"
        )
    checked: list[pb_utils.InferenceResponse | None] = []
    for request, response in zip(served, responses, strict=True):
        usual = request._release_flags == _RELEASE_ALL and request._refused is None
        if usual and type(response) is _RESPONSE:  # released, and answered
            checked.append(response)
            continue
        if request._refused is not None:
            response = pb_utils.InferenceResponse(error=request._refused)
        elif request._rescheduled() and response is not None:
            # Triton's words, spelling included: clients match on them. The request
            # ends here with this error.
            message = (
                "Expected a None object in the execute function return list for reschduled "
                f"request, got {type(response).__name__}"
            )
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        elif not request._rescheduled() and not isinstance(response, pb_utils.InferenceResponse):
            raise InternalError(
                f"model '{model_name}': execute returned {type(response).__name__}, "
                "not an InferenceResponse"
            )
        checked.append(response)
    return checked


def _refuse_rescheduling(
    model_name: str, decoupled: bool, request: pb_utils.InferenceRequest
) -> None:
    """A model without iterative sequences rescheduled ``request``: it is released with
    the reason (a decoupled model's through its sender)."""
    if not request._rescheduled():
        return
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
    request._refused = pb_utils.TritonError(
        f"model '{model_name}' rescheduled a request "
        "(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE), which needs "
        "'sequence_batching { iterative_sequence: true }' in its configuration"
    )
    if decoupled:
        with contextlib.suppress(pb_utils.TritonModelException):  # it sent its final already
            request.get_response_sender().send(
                pb_utils.InferenceResponse(error=request._refused),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )


def failure_texts(instance_name: str, exc: BaseException, repository: Path) -> tuple[str, str]:
    """What ``execute`` raised, as Triton words it: for the log (every frame of the
    model) and for the client (the model's frames, named from the repository)."""
    failed = f"Failed to process the request(s) for model instance '{instance_name}', message: "
    # The client reads the model's own frames by their place in the repository: the
    # server's folders are not its business.
    return failed + described(exc), failed + described(exc, repository)


def described(exc: BaseException, repository: Path | None = None) -> str:
    """An exception as Triton's stub tells it: type, message, then "At:" and the model's
    frames, innermost first. Given the ``repository`` folder, only the frames of its files,
    named relative to it."""
    frames = []
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename)
        if frame.filename.startswith(_SERVER_FILES):
            continue
        if repository is not None:
            if not path.is_relative_to(repository):
                continue
            path = path.relative_to(repository)
        frames.append(f"  {path}({frame.lineno}): {frame.name}\n")
    text = f"{type(exc).__name__}: {exc}"
    return f"{text}\n\nAt:\n{''.join(frames)}" if frames else text


async def _coroutine(work: Awaitable[Any]) -> Any:
    return await work
