"""``triton_python_backend_utils``: what a Triton Python-backend ``model.py`` imports.

The python backend registers this module under that name, so ``import
triton_python_backend_utils as pb_utils`` works unchanged. Tensors are numpy arrays on the
host. BLS requests (``InferenceRequest(...).exec()`` / ``async_exec()``) call the served
model in this process, through the repository the executing model was loaded into.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import trio

from .._errors import (
    AlreadyExistsError,
    CancelledError,
    InferenceServerError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
    UnsupportedError,
)
from .._repository import ModelRepository
from .._tensor import datatype, datatype_from_config, datatype_of
from .._types import InferenceRequest as CoreRequest
from .._types import InputTensor, RequestedOutput, ResponseSender
from ..tracing import Trace, infer_child
from ._auto_complete import ModelConfig as ModelConfig
from ._pb_metrics import COUNTER as COUNTER
from ._pb_metrics import GAUGE as GAUGE
from ._pb_metrics import HISTOGRAM as HISTOGRAM
from ._pb_metrics import Metric as Metric
from ._pb_metrics import MetricFamily as MetricFamily

Array = np.ndarray[Any, Any]

# The repository of the model executing on this thread (or task): where BLS requests go.
serving_repository: contextvars.ContextVar[ModelRepository] = contextvars.ContextVar(
    "serving_repository"
)

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2


class TritonModelException(Exception):
    """Raised by a model: its message fails the requests of the execution."""


class TritonError:
    """An error carried by a response (or raised from BLS), with Triton's codes."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


_ERROR_BY_CODE: dict[int, type[InferenceServerError]] = {
    TritonError.INTERNAL: InternalError,
    TritonError.NOT_FOUND: NotFoundError,
    TritonError.INVALID_ARG: InvalidArgumentError,
    TritonError.UNAVAILABLE: UnavailableError,
    TritonError.UNSUPPORTED: UnsupportedError,
    TritonError.ALREADY_EXISTS: AlreadyExistsError,
    TritonError.CANCELLED: CancelledError,
}
_CODE_BY_ERROR = {kind: code for code, kind in _ERROR_BY_CODE.items()}


def server_error(error: TritonError) -> InferenceServerError:
    return _ERROR_BY_CODE.get(error.code(), InternalError)(error.message())


def triton_error(error: InferenceServerError) -> TritonError:
    return TritonError(str(error), _CODE_BY_ERROR.get(type(error), TritonError.UNKNOWN))


class _Capsule:
    """Hands a DLPack capsule to numpy, which consumes objects with ``__dlpack__``."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class Tensor:
    """A named tensor on the host."""

    def __init__(self, name: str, data: Any, *, triton_dtype: str | None = None) -> None:
        array = np.asarray(data)
        if array.dtype.kind in "SU":  # BYTES travel as an object array of bytes
            array = np.array(
                [x.encode() if isinstance(x, str) else bytes(x) for x in array.reshape(-1)],
                dtype=np.object_,
            ).reshape(array.shape)
        self._name = name
        self._array = array
        self._datatype = triton_dtype or datatype_of(array).name

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> Array:
        return self._array

    def triton_dtype(self) -> str:
        return self._datatype

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        source = capsule if hasattr(capsule, "__dlpack__") else _Capsule(capsule)
        return Tensor(name, np.from_dlpack(source))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {self._datatype}, shape={self.shape()})"


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
        return json.dumps(dict(self._parameters or {}))


class InferenceRequest:
    """A request as a model's ``execute`` sees it, or a BLS request a model builds."""

    def __init__(
        self,
        model_name: str = "",
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        model_version: int = -1,
        request_id: str = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        parameters: Mapping[str, Any] | str | None = None,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
    ) -> None:
        self._model_name = model_name
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._model_version = model_version
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._parameters = json.loads(parameters) if isinstance(parameters, str) else parameters
        self._timeout = timeout
        self._sender: ResponseSender | None = None  # a served request to a decoupled model
        # A BLS request given ``trace=request.trace()`` is traced under that request.
        self._trace: Trace | None = trace.parent if isinstance(trace, InferenceTrace) else None

    @classmethod
    def _served(cls, request: CoreRequest) -> InferenceRequest:
        """The view of a request this server received."""
        inputs = [
            Tensor(t.name, t.data, triton_dtype=t.datatype.name) for t in request.inputs.values()
        ]
        parameters = request.parameters
        flags = 0
        if parameters.get("sequence_start") is True:
            flags |= TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        if parameters.get("sequence_end") is True:
            flags |= TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
        served = cls(
            model_name=request.model_name,
            inputs=inputs,
            requested_output_names=[o.name for o in request.outputs],
            request_id=request.id,
            correlation_id=parameters.get("sequence_id", 0),
            flags=flags,
            parameters=dict(parameters),
        )
        served._sender = request.response_sender
        served._trace = request.trace
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

    def model_name(self) -> str:
        return self._model_name

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return json.dumps(dict(self._parameters or {}))

    def is_cancelled(self) -> bool:
        return self._sender is not None and self._sender.cancelled

    def trace(self) -> InferenceTrace:
        """This request's trace, to pass to the BLS requests it makes."""
        return InferenceTrace(self._trace)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "get_response_sender is only available to the requests of decoupled models"
            )
        return InferenceResponseSender(self._sender)

    def exec(self, decoupled: bool = False) -> InferenceResponse:
        """Run this request on the served model and wait for its response (from a model's
        worker thread)."""
        _no_decoupled(decoupled)
        repository = serving_repository.get()
        return trio.from_thread.run(_infer, repository, self._core_request(), self._trace)

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse:
        """``exec`` for a model whose ``execute`` is ``async``."""
        _no_decoupled(decoupled)
        return await _infer(serving_repository.get(), self._core_request(), self._trace)

    def _core_request(self) -> CoreRequest:
        version = "" if self._model_version < 0 else str(self._model_version)
        inputs = {}
        for tensor in self._inputs:
            array = tensor.as_numpy()
            inputs[tensor.name()] = InputTensor(
                tensor.name(), datatype(tensor.triton_dtype()), tuple(array.shape), array
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


class InferenceTrace:
    """A request's trace as a model sees it (Triton's ``InferenceTrace``)."""

    def __init__(self, parent: Trace | None) -> None:
        self.parent = parent

    def get_context(self) -> str | None:
        """The client's W3C trace context (JSON), if it sent one."""
        context = None if self.parent is None else self.parent.context
        return None if context is None else json.dumps(dict(context))


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


def _no_decoupled(decoupled: bool) -> None:
    if decoupled:
        raise TritonModelException("decoupled BLS requests are not supported yet")


async def _infer(
    repository: ModelRepository, request: CoreRequest, trace: Trace | None
) -> InferenceResponse:
    try:
        runner = repository.get(request.model_name, request.model_version)
        response = await infer_child(runner, request, trace)
    except InferenceServerError as exc:
        return InferenceResponse(error=triton_error(exc))
    outputs = [Tensor(t.name, t.data, triton_dtype=t.datatype.name) for t in response.outputs]
    return InferenceResponse(outputs, parameters=dict(response.parameters))


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> Any:
    return next((t for t in model_config.get("input", ()) if t["name"] == name), None)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> Any:
    return next((t for t in model_config.get("output", ()) if t["name"] == name), None)


def triton_string_to_numpy(triton_type: str) -> Any:
    """``TYPE_FP32`` -> ``numpy.float32``; ``TYPE_STRING`` -> ``numpy.object_``."""
    found = datatype_from_config(triton_type)
    return np.object_ if found.is_bytes else found.dtype.type


def numpy_to_triton_type(dtype: Any) -> str:
    return datatype_of(np.empty(0, dtype=dtype)).config_name


class Logger:
    """Triton's model logger, on the ``trioserve.python_backend`` logger."""

    INFO = logging.INFO
    WARNING = logging.WARNING
    ERROR = logging.ERROR
    VERBOSE = logging.DEBUG

    _logger = logging.getLogger("trioserve.python_backend")

    @classmethod
    def log(cls, message: str, level: int = INFO) -> None:
        cls._logger.log(level, "%s", message)

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.log(message, cls.INFO)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.log(message, cls.WARNING)

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.log(message, cls.ERROR)

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.log(message, cls.VERBOSE)
