"""The server as model code in an instance process sees it: ``RemoteLink`` forwards what
``pb_utils`` asks (BLS requests, model control, a decoupled request's cancellation) over
the process's link; ``RemoteSender`` sends a decoupled model's responses;
``RemoteFamilies`` forwards custom metrics; ``ServerLogHandler`` sends log records to
the server's log. Nothing here imports trio: the stub (``_pb_stub``) runs it.

A call is one frame out (``call``) and its answer back (``reply``), matched by call id;
a decoupled BLS stream gets its responses as ``item`` replies, then a last reply. The
tensors a BLS request sends lie in the process's own arena until the call ends; those
its answer brings lie in the server's, and are copied out then given back at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .._errors import InvalidArgumentError, UnavailableError
from .._tensor import datatype, datatype_of
from .._types import InferenceRequest as CoreRequest
from .._types import InferenceResponse as CoreResponse
from .._types import OutputTensor
from ..ipc._arena import Arena, Block, SegmentMap
from ..ipc._blocking import LinkClosed
from ._pb_metrics import MetricError, _FamilyState
from ._pb_serving import Waiting
from ._pb_turns import Turns
from ._pb_wire import (
    WireTensor,
    error_from_wire,
    error_to_wire,
    frame_tensor,
    put_tensor,
    read_tensor,
)

Deliver = Callable[[Any], None]
Push = Callable[[Any, bool], None]


class Stub(Protocol):
    """The instance process's end of the link (``_pb_stub.Stub``)."""

    arena: Arena  # the process's own: outputs, BLS inputs
    server_memory: SegmentMap  # the server's arena, mapped
    link: RemoteLink
    turns: Turns  # asked for a reader before each call to the server

    def send(self, message: tuple[Any, ...], blocks: Sequence[Block] = ()) -> None: ...


@dataclass(frozen=True, slots=True)
class Call:
    """A call for the server: its kind, its arguments and, for a stream, where each
    response goes."""

    kind: str
    args: tuple[Any, ...]
    push: Push | None = None


class RemoteLink(Waiting):
    """``_pb_serving.Link`` over the process's link."""

    def __init__(self, stub: Stub) -> None:
        self._stub = stub
        self._ids = itertools.count(1)
        self._open: dict[int, tuple[Deliver, Push | None, list[Block]]] = {}
        self._lock = threading.Lock()

    def start(self, work: Callable[[], Any], deliver: Deliver) -> Callable[[], None]:
        call: Call = work()
        call_id = next(self._ids)
        args, blocks = self._encoded(call)
        with self._lock:
            self._open[call_id] = (deliver, call.push, blocks)
        self._stub.turns.need_reader()
        try:
            self._stub.send(("call", call_id, call.kind, args), blocks)
        except LinkClosed:
            self.replied(call_id, ("error", error_to_wire(UnavailableError("the server is gone"))))
        return lambda: self._cancel(call_id)

    def _cancel(self, call_id: int) -> None:
        if call_id in self._open:
            self._stub.send(("cancel", call_id))

    def _encoded(self, call: Call) -> tuple[tuple[Any, ...], list[Block]]:
        """The call's arguments for the frame; a request's tensors go into the arena."""
        if call.kind not in ("infer", "stream"):
            return call.args, []
        request: CoreRequest = call.args[0]
        arena = self._stub.arena
        tensors = [
            put_tensor(arena, t.name, t.datatype.name, t.data) for t in request.inputs.values()
        ]
        described = (
            request.model_name,
            request.model_version,
            tensors,
            [o.name for o in request.outputs],
            request.id,
            dict(request.parameters),
        )
        return (described,), [t.block for t in tensors]

    def replied(self, call_id: int, outcome: tuple[Any, ...]) -> None:
        """An answer from the server (the reading thread): a stream's ``item``, or the
        call's last answer."""
        with self._lock:
            entry = (
                self._open.get(call_id) if outcome[0] == "item" else self._open.pop(call_id, None)
            )
        if entry is None:
            return
        deliver, push, blocks = entry
        if outcome[0] == "item":
            assert push is not None
            push(self._answer(outcome[1]), outcome[2])
            return
        for block in blocks:
            self._stub.arena.free(block)
        deliver(self._answer(outcome))

    def _answer(self, answer: tuple[Any, ...] | None) -> Any:
        if answer is None:
            return None
        kind, value = answer
        if kind == "error":
            return error_from_wire(value)
        if kind == "response":
            return self._response(*value)
        return value

    def _response(
        self, name: str, version: str, tensors: list[WireTensor], request_id: str, parameters: Any
    ) -> CoreResponse:
        outputs = []
        view = self._stub.server_memory.view
        for tensor in tensors:
            data = np.array(read_tensor(tensor, view(tensor.block)))  # copied: given back now
            outputs.append(OutputTensor(tensor.name, datatype(tensor.datatype), data))
        self._stub.send(("release", [t.block for t in tensors]))
        return CoreResponse(name, version, outputs, id=request_id, parameters=parameters)

    # --- the calls, as ``_pb_serving.Link`` names them --------------------------------

    def infer(self, request: CoreRequest, trace: object) -> Call:
        return Call("infer", (request,))

    def stream(self, request: CoreRequest, push: Push) -> Call:
        return Call("stream", (request,), push)

    def load(self, name: str, config: str, files: Mapping[str, bytes]) -> Call:
        return Call("load", (name, config, dict(files)))

    def unload(self, name: str, unload_dependents: bool) -> Call:
        return Call("unload", (name, unload_dependents))

    def model_ready(self, name: str, version: str) -> Call:
        return Call("model_ready", (name, version))


class RemoteSender:
    """A decoupled request's ``ResponseSender`` in the instance process."""

    def __init__(self, stub: Stub, key: int) -> None:
        self._stub = stub
        self._key = key
        self._final_sent = False

    def send(
        self, outputs: Mapping[str, Any] | Exception | None = None, *, final: bool = False
    ) -> None:
        if self._final_sent:
            raise InvalidArgumentError("the final response of this request was already sent")
        self._final_sent = final
        payload: tuple[Any, ...] | None = None
        blocks: list[Block] = []
        if isinstance(outputs, Exception):
            payload = ("error", error_to_wire(outputs))
        elif outputs is not None:
            # Small outputs ride in the frame, as ``execute``'s answers do: no block to
            # place, read and give back for each of a stream's many small responses.
            arena = self._stub.arena
            tensors = []
            for name, data in outputs.items():
                array = np.asarray(data)
                tensors.append(frame_tensor(arena, name, datatype_of(array).name, array, blocks))
            payload = ("outputs", tensors)
        try:
            self._stub.send(("send", self._key, payload, final), blocks)
        except LinkClosed:
            raise UnavailableError("the server is gone") from None

    @property
    def cancelled(self) -> bool:
        """Whether the client gave up (asked of the server)."""
        link = self._stub.link
        return bool(link.wait(lambda: Call("cancelled", (self._key,))))


class RemoteFamilies:
    """``_pb_metrics.Families`` in an instance process: a local copy of each family whose
    changes go to the server's."""

    def __init__(self, stub: Stub) -> None:
        self._stub = stub
        self._families: dict[str, _FamilyState] = {}
        self._lock = threading.Lock()

    def family(self, name: str, description: str, kind: int, owner: object) -> _FamilyState:
        link = self._stub.link
        refused = link.wait(lambda: Call("family", (name, description, kind)))
        if refused is not None:
            raise MetricError(refused)
        with self._lock:
            state = self._families.get(name)
            if state is None:
                state = self._families[name] = _FamilyState(name, description, kind)
                state.forward = self._forward
            return state

    def _forward(
        self, state: _FamilyState, key: tuple[tuple[str, str], ...], change: str, value: float
    ) -> None:
        bounds = state.metrics[key].snapshot()[1]
        family = (state.name, state.description, state.kind)
        self._stub.send(("metric", family, key, bounds, change, value))


class ServerLogHandler(logging.Handler):
    """Sends each record to the server, which logs it on its own logger of that name."""

    def __init__(self, stub: Stub) -> None:
        super().__init__()
        self._stub = stub

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(LinkClosed):
            self._stub.send(("log", record.name, record.levelno, self.format(record)))
