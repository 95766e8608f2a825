"""``pb_utils``'s requests and responses: the requests a model's ``execute`` receives, the
BLS requests it makes (``exec``, ``async_exec``, one response or a decoupled model's
stream of them), its responses and a decoupled model's response sender.

BLS calls go through the ``ServerLink`` of the model running (``_pb_link.current``):
``exec`` blocks its thread until the answer comes; ``async_exec`` returns an asyncio
future at once, resolved from trio, so ``asyncio.gather`` runs many together; with
``decoupled=True`` both give a ``ResponseIterator``, iterated with ``for`` (blocking,
as in Triton) or ``async for``.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import InferenceServerError
from .._tensor import datatype
from .._types import InferenceRequest as CoreRequest
from .._types import InferenceResponse as CoreResponse
from .._types import InputTensor, RequestedOutput, ResponseSender
from ._pb_serving import current
from ._pb_tensors import Tensor, TritonError, TritonModelException, server_error, triton_error

if TYPE_CHECKING:  # asyncio is imported once model code runs a loop, not with the server
    import asyncio

    from ..tracing import Trace

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_GPU = 0
TRITONSERVER_MEMORY_CPU = 1


class PreferredMemory:
    """Where a BLS request would like its outputs. Outputs are host arrays here, so any
    preference is met on the host."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceTrace:
    """A request's trace as a model sees it (Triton's ``InferenceTrace``): what a BLS
    request given ``trace=request.trace()`` is traced under."""

    def __init__(self, parent: Trace | None = None) -> None:
        self.parent = parent  # None: the request is not traced

    def get_context(self) -> str | None:
        """The client's W3C trace context (JSON), if it sent one."""
        context = None if self.parent is None else self.parent.context
        return None if context is None else json.dumps(dict(context))


_UNTRACED = InferenceTrace()  # what a request not traced carries (nothing to change in it)


class InferenceResponse:
    """One request's outputs, or its error."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] = (),
        error: TritonError | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors)
        self._error = error
        self._parameters = json.loads(parameters) if isinstance(parameters, str) else parameters

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(dict(self._parameters)) if self._parameters else "{}"

    @classmethod
    def _answer(cls, answer: CoreResponse | BaseException | None) -> InferenceResponse:
        """A BLS answer as the model sees it: outputs, an error, or nothing (a decoupled
        model's final flag sent alone)."""
        if answer is None:
            return cls()
        if isinstance(answer, InferenceServerError):
            return cls(error=triton_error(answer))
        if isinstance(answer, BaseException):
            return cls(error=TritonError(f"{type(answer).__name__}: {answer}"))
        outputs = [Tensor(t.name, t.data, triton_dtype=t.datatype.name) for t in answer.outputs]
        return cls(outputs, parameters=dict(answer.parameters))


class ResponseIterator:
    """The responses of a decoupled BLS request, up to and with the final one (which may
    carry no outputs), filled from trio as they come."""

    def __init__(self) -> None:
        self._responses: deque[InferenceResponse] = deque()
        self._ended = False  # the final response has come
        self._lock = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._cancel: Callable[[], None] | None = None

    def _push(self, answer: CoreResponse | BaseException | None, final: bool) -> None:
        with self._lock:
            if self._ended:
                return
            self._responses.append(InferenceResponse._answer(answer))
            self._ended = final
            self._lock.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            _settle(loop, future, None)

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        with self._lock:
            while not self._responses:
                if self._ended:
                    raise StopIteration
                self._lock.wait()
            return self._responses.popleft()

    def __aiter__(self) -> ResponseIterator:
        return self

    async def __anext__(self) -> InferenceResponse:
        import asyncio

        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._responses:
                    return self._responses.popleft()
                if self._ended:
                    raise StopAsyncIteration
                future: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, future))
            await future

    def cancel(self) -> None:
        """Cancel the request: the model it went to sees it cancelled."""
        if self._cancel is not None:
            self._cancel()


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], outcome: Any) -> None:
    """Resolve an asyncio future from another thread (it may have been cancelled, or its
    loop closed, meanwhile)."""

    def settle() -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
        loop.call_soon_threadsafe(settle)


class InferenceRequest:
    """A request as a model's ``execute`` sees it, or a BLS request a model builds.
    Arguments as Triton takes them; ``model_name`` may be bytes (a STRING input's
    element), read as UTF-8."""

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        model_name: str | bytes = "",
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> None:
        if isinstance(model_name, bytes):
            model_name = model_name.decode()
        if not isinstance(correlation_id, (int, str)):
            raise TritonModelException("Correlation ID must be integer or string")
        self._model_name = str(model_name)
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._model_version = model_version
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._parameters = json.loads(parameters) if isinstance(parameters, str) else parameters
        self._timeout = timeout
        self._preferred_memory = preferred_memory  # None: the default (outputs on the host)
        self._trace = trace or _UNTRACED
        self._sender: ResponseSender | None = None  # a served request to a decoupled model
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self._refused: TritonError | None = None  # why it could not be rescheduled

    @classmethod
    def _served(cls, request: CoreRequest) -> InferenceRequest:
        """The view of a request this server received."""
        inputs = [
            Tensor(t.name, t.data, triton_dtype=t.datatype.name) for t in request.inputs.values()
        ]
        return cls._received(
            request.model_name,
            inputs,
            [o.name for o in request.outputs],
            request.id,
            request.parameters,
            request.response_sender,
            InferenceTrace(request.trace),
        )

    @classmethod
    def _received(
        cls,
        model_name: str,
        inputs: list[Tensor],
        requested: list[str],
        request_id: str,
        parameters: Mapping[str, Any],
        sender: ResponseSender | None,
        trace: InferenceTrace | None = None,
    ) -> InferenceRequest:
        """A request the server received, wherever the model runs: the sequence batcher's
        parameters become Triton's correlation id and flags."""
        flags = 0
        if parameters.get("sequence_start") is True:
            flags |= TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        if parameters.get("sequence_end") is True:
            flags |= TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
        served = cls(
            model_name=model_name,
            inputs=inputs,
            requested_output_names=requested,
            request_id=request_id,
            correlation_id=parameters.get("sequence_id", 0),
            flags=flags,
            trace=trace,
            parameters=dict(parameters),
        )
        served._sender = sender
        return served

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def model_name(self) -> str:
        return self._model_name

    def timeout(self) -> int:
        return self._timeout

    def trace(self) -> InferenceTrace:
        return self._trace

    def parameters(self) -> str:
        return json.dumps(dict(self._parameters)) if self._parameters else "{}"

    def is_cancelled(self) -> bool:
        return self._sender is not None and self._sender.cancelled

    def set_release_flags(self, flags: int) -> None:
        """``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: once ``execute`` returns, the
        request is not released but executed again in a later batch (a model with
        ``sequence_batching { iterative_sequence: true }``; a non-decoupled model returns
        None in its place). ``TRITONSERVER_REQUEST_RELEASE_ALL``, every request's
        default, releases it."""
        self._release_flags = flags

    def _rescheduled(self) -> bool:
        return bool(self._release_flags & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "get_response_sender is only available to the requests of decoupled models"
            )
        return InferenceResponseSender(self._sender)

    def exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """Run this request on the model it names and wait for its response; with
        ``decoupled``, the iterator of its responses (at once)."""
        if decoupled:
            return self._stream()
        link = current("InferenceRequest.exec").link
        core = self._core_request()
        try:
            return InferenceResponse._answer(
                link.wait(lambda: link.infer(core, self._trace.parent))
            )
        except InferenceServerError as exc:
            return InferenceResponse._answer(exc)

    def async_exec(self, decoupled: bool = False) -> asyncio.Future[Any]:
        """``exec`` for an ``async`` model: an asyncio future of the response (or of the
        iterator of responses), the request already under way."""
        import asyncio

        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if decoupled:
            future.set_result(self._stream())
            return future
        link = current("InferenceRequest.async_exec").link
        core = self._core_request()
        cancel = link.start(
            lambda: link.infer(core, self._trace.parent),
            lambda outcome: _settle(loop, future, InferenceResponse._answer(outcome)),
        )
        future.add_done_callback(lambda done: cancel() if done.cancelled() else None)
        return future

    def _stream(self) -> ResponseIterator:
        link = current("InferenceRequest.exec").link
        core = self._core_request()
        responses = ResponseIterator()

        def ended(outcome: object) -> None:
            # An error before the final response ends the stream with it.
            responses._push(outcome if isinstance(outcome, BaseException) else None, True)

        responses._cancel = link.start(lambda: link.stream(core, responses._push), ended)
        return responses

    def _core_request(self) -> CoreRequest:
        version = "" if self._model_version < 0 else str(self._model_version)
        inputs = {}
        for tensor in self._inputs:
            array = tensor.as_numpy()
            inputs[tensor.name()] = InputTensor(
                tensor.name(), datatype(tensor.datatype_name()), tuple(array.shape), array
            )
        parameters = dict(self._parameters or {})
        if self._correlation_id not in (0, ""):  # a request of a sequence
            parameters["sequence_id"] = self._correlation_id
            parameters["sequence_start"] = bool(
                self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
            )
            parameters["sequence_end"] = bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
        return CoreRequest(
            self._model_name,
            version,
            inputs,
            [RequestedOutput(name) for name in self._requested],
            id=self._request_id,
            parameters=parameters,
        )


class InferenceResponseSender:
    """Sends a decoupled model's responses to one request, from any thread."""

    def __init__(self, sender: ResponseSender) -> None:
        self._sender = sender

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is None and not final:
            raise TritonModelException("send needs a response, the final flag, or both")
        outputs: Mapping[str, Any] | Exception | None = None
        if response is not None:
            error = response.error()
            if error is not None:
                outputs = server_error(error)
            else:
                outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
        try:
            self._sender.send(outputs, final=final)
        except InferenceServerError as exc:
            raise TritonModelException(exc.message) from None

    def is_cancelled(self) -> bool:
        return self._sender.cancelled
