"""A trioserve ``Model`` in its instance process: the process's side of a model of
trioserve's own layout that runs in process mode (``_own_processes`` is the server's).

The stub (``_pb_stub``) is told so by its ``init`` frame (``"api": "trioserve"``) and
hands ``OwnInstance`` the model's work: the model.py is imported as the server imported
it (``_own_layout``), its module-level ``model`` loaded once, and each batch of the
``exec`` frames given to its ``execute`` as trioserve ``InferenceRequest``s whose inputs
are read-only numpy arrays over the server's arena (or over the frame, for small ones).
What it returns for each request (a mapping of output name to array, ``ResponseOutputs``
with parameters, or an ``InferenceServerError``) goes back as the stub answers any model:
outputs in this process's arena, errors by class and message, so that their status
(INVALID_ARG: HTTP 400, gRPC INVALID_ARGUMENT) is kept. An exception from ``execute``
fails its batch, with the words the server's process would use. A decoupled model's
requests carry a ``_pb_remote.RemoteSender`` (trioserve's ``ResponseSender``: each
response goes to the server as it is sent, from any thread, even after ``execute``
returned). ``unload`` runs when the stub finalizes.

Users write trio code: an ``async`` ``execute``, ``load`` or ``unload`` is awaited on a
trio loop of the process's own (``TrioThread``), the calling thread waiting for it, and
one loop for the process's life keeps what the model made for it from one batch to the
next. A plain ``execute`` runs in the thread that read its batch, as a Python-backend
model's does. ``MODEL_INSTANCE`` reads the instance's index, as in the server's
process. Unlike the stub, this module imports trio and the rest of trioserve: a
trioserve model's process has the server's package on its path (``_pb_launch``).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import trio

from .._errors import InferenceServerError, InternalError
from .._model import MODEL_INSTANCE, ResponseOutputs, TensorSpec
from .._model_code import failure_message, model_failure
from .._tensor import datatype
from .._types import InferenceRequest, InputTensor, RequestedOutput
from ..ipc._arena import Block
from ..shm._cuda import is_device_array, to_host
from . import _pb_utils as pb_utils
from ._own_layout import load_model_file
from ._pb_remote import RemoteSender
from ._pb_remote import Stub as RemoteStub
from ._pb_wire import Array, FrameTensor, WireError, error_to_wire

T = TypeVar("T")
logger = logging.getLogger("trioserve.python_backend")  # forwarded to the server's log


class Stub(RemoteStub, Protocol):
    """What an instance uses of its process's ``_pb_stub.Stub``."""

    def array_of(self, tensor: FrameTensor) -> Array: ...

    def response_result(
        self,
        response: pb_utils.InferenceResponse,
        blocks: list[Block],
        placed: dict[str, tuple[int, int, int, str]],
    ) -> tuple[Any, ...]: ...


class TrioThread:
    """A trio loop in a daemon thread, for the process's life (the process ends with
    ``os._exit``, whatever runs on it)."""

    def __init__(self) -> None:
        tokens: list[trio.lowlevel.TrioToken] = []
        running = threading.Event()

        async def serve() -> None:
            tokens.append(trio.lowlevel.current_trio_token())
            running.set()
            await trio.sleep_forever()

        threading.Thread(target=trio.run, args=(serve,), name="model trio", daemon=True).start()
        running.wait()
        self._token = tokens[0]

    def run(self, awaitable: Awaitable[T], instance: int) -> T:
        """Await ``awaitable`` in a task of the loop, as model instance ``instance``; from
        any thread but the loop's."""

        async def awaited() -> T:
            MODEL_INSTANCE.set(instance)  # the task's own context
            return await awaitable

        return trio.from_thread.run(awaited, trio_token=self._token)


class OwnInstance:
    """One instance of a trioserve ``Model``, loaded in this process."""

    def __init__(self, stub: Stub, settings: dict[str, Any]) -> None:
        self._stub = stub
        self._name: str = settings["name"]
        self._version: str = settings["version"]
        self._index: int = settings["instance"]
        self._trio = TrioThread()
        self.model = load_model_file(
            Path(settings["model_file"]), self._name, settings["folder_version"]
        )
        self._call(self.model.load)
        # What the model says of itself, for the server's readiness and statistics:
        # its memory once (the server reads it after the load), its unavailability
        # again whenever a batch changed it.
        self._unavailable = self._call(self.model.unavailable)
        usage = [(m.kind, m.id, m.byte_size) for m in self._call(self.model.memory_usage)]
        stub.send(("state", self._unavailable, usage))

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        """Call model code as this instance; what it returns, awaited on the trio loop if
        it is awaitable."""
        token = MODEL_INSTANCE.set(self._index)
        try:
            returned = function(*args)
        finally:
            MODEL_INSTANCE.reset(token)
        if inspect.isawaitable(returned):
            return self._trio.run(returned, self._index)
        return returned

    def execute(
        self,
        batch: int,
        described: list[tuple[Any, ...]],
        refused: dict[int, tuple[int, InferenceServerError]],
    ) -> None:
        """Run a batch and send its ``done`` frame. ``refused``: the requests whose inputs
        could not be read (by their place in the batch), answered with their error."""
        stub = self._stub
        decoupled = self.model.decoupled
        if decoupled:  # a refused request is answered through its sender
            for key, error in refused.values():
                stub.send(("send", key, ("error", error_to_wire(error)), True))
        try:
            requests = [self._request(d, decoupled) for d in described]
            returned = self._call(self.model.execute, requests) if requests else []
            # A decoupled model answered through its senders: what it returned is ignored.
            results = [] if decoupled else list(returned)
            if len(results) != len(described) and not decoupled:
                raise InternalError(
                    f"model returned {len(results)} results for {len(described)} requests"
                )
        except BaseException as exc:  # the model's, whatever it is
            self._report_unavailable()
            stub.send(("done", batch, ("failed", self._error(exc))))
            return
        self._report_unavailable()  # before the answers: a client then sees it
        if decoupled:
            stub.send(("done", batch, ("results", [])))
            return
        blocks: list[Block] = []
        answers = [self._answer(r, d, blocks) for r, d in zip(results, described, strict=True)]
        for place, (_key, error) in sorted(refused.items()):
            answers.insert(place, ("error", error_to_wire(error)))
        stub.send(("done", batch, ("results", answers)), blocks)

    def unload(self) -> None:
        self._call(self.model.unload)

    def _report_unavailable(self) -> None:
        try:
            reason = self._call(self.model.unavailable)
        except Exception as exc:  # the model's: it cannot say it serves
            reason = f"its unavailable() raised {exc!r}"
        if reason != self._unavailable:
            self._unavailable = reason
            self._stub.send(("state", reason, None))

    def _request(self, described: tuple[Any, ...], decoupled: bool) -> InferenceRequest:
        """A request of an ``exec`` frame (as ``_pb_process`` describes it); a decoupled
        model's answers through a sender whose responses go to the server as they come."""
        key, request_id, model, tensors, outputs, parameters, _placed = described
        inputs = {
            t[0]: InputTensor(t[0], datatype(t[1]), tuple(t[2]), self._stub.array_of(t))
            for t in tensors
        }
        requested = [RequestedOutput(name) for name in outputs]
        return InferenceRequest(
            model,
            self._version,
            inputs,
            requested,
            id=request_id,
            parameters=parameters,
            response_sender=RemoteSender(self._stub, key) if decoupled else None,
        )

    def _answer(self, result: Any, described: tuple[Any, ...], blocks: list[Block]) -> Any:
        """A request's result for the ``done`` frame; its outputs' blocks added to
        ``blocks``."""
        if isinstance(result, InferenceServerError):
            return ("error", error_to_wire(result))
        try:
            response = self._response(result, described[4])
        except Exception as exc:
            return ("error", self._error(exc))
        return self._stub.response_result(response, blocks, described[6])

    def _response(self, outputs: Any, requested: list[str]) -> pb_utils.InferenceResponse:
        """The outputs the request asked for (every declared one if it named none) in
        their declared datatypes, as the server would convert them; one the model did
        not make is left for the server to name."""
        if not isinstance(outputs, Mapping):
            raise TypeError(
                f"model {self._name!r} returned {type(outputs).__name__}, not a mapping"
            )
        specs = self.model.output_specs
        tensors = [
            pb_utils.Tensor(name, _declared(outputs[name], specs.get(name)))
            for name in requested or specs
            if name in outputs
        ]
        parameters = outputs.parameters if isinstance(outputs, ResponseOutputs) else None
        return pb_utils.InferenceResponse(tensors, parameters=parameters)

    def _error(self, exc: BaseException) -> WireError:
        """What model code raised, as the server's process tells it: an
        ``InferenceServerError`` as it is, anything else logged and told as an internal
        error naming the model."""
        if isinstance(exc, InferenceServerError):
            return error_to_wire(exc)
        failure = model_failure(exc, self._name, "in execute")
        logger.warning("model %r failed: %r", self._name, failure)
        return error_to_wire(InternalError(failure_message(self._name, failure)))


def _declared(value: Any, spec: TensorSpec | None) -> np.ndarray[Any, Any]:
    """An output on the host, in its declared datatype unless BYTES (the server checks
    those)."""
    array = to_host(value) if is_device_array(value) else np.asarray(value)
    if spec is None or spec.wire_datatype.is_bytes or array.dtype == spec.wire_datatype.dtype:
        return array
    return array.astype(spec.wire_datatype.dtype)
