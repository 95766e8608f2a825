"""The handlers of ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``.

Handlers run on the asyncio side of the bridge (grpclib is asyncio code) and never touch
trio themselves: what must run in trio, ``ServedModel.infer`` and a whole
ModelStreamInfer call, goes through the ``Infer`` and ``StreamInfer`` callables the
bridge hands in. Everything else they read (readiness, metadata, config) is plain
synchronous state of the repository.

Each handler body is wrapped by ``_rpc``, the one place that turns failures into gRPC
statuses: an ``InferenceServerError`` through the table in ``_errors``, anything else
into INTERNAL (logged, since it is a bug of ours).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.server import Stream

from .._errors import (
    InferenceServerError,
    InternalError,
    InvalidArgumentError,
    UnsupportedError,
    unknown_model,
)
from .._repository import ModelRepository, ServedModel
from .._types import InferenceRequest, InferenceResponse
from ._codec import (
    decode_request,
    encode_response,
    model_config_message,
    model_metadata_message,
    server_metadata_message,
)
from ._errors import grpc_error
from ._generated import grpc_service_grpc, health_grpc, health_pb2
from ._generated import grpc_service_pb2 as pb

logger = logging.getLogger("trioserve.grpc")

# Runs ``served.infer(request)`` where it must run (in trio) and awaits it from asyncio.
# Cancelling the await must cancel the call: that is how a client's disconnect or
# deadline withdraws a queued request.
Infer = Callable[[ServedModel, InferenceRequest], Awaitable[InferenceResponse]]
# Serves one ModelStreamInfer call in trio (``_stream.StreamInfer``), awaited from asyncio.
StreamInfer = Callable[[Stream[Any, Any]], Awaitable[None]]

_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[None]])

# Service names a health check may ask about that mean "the server as a whole".
_SERVER_SERVICES = frozenset({"", "inference.GRPCInferenceService"})


def _rpc(handler: _Handler) -> _Handler:
    """Answer every failure of ``handler`` with a status from the one table."""

    @functools.wraps(handler)
    async def wrapper(self: Any, stream: Stream[Any, Any]) -> None:
        try:
            await handler(self, stream)
        except (GRPCError, StreamTerminatedError):
            raise  # already a status (e.g. a message over the size limit), or no client
        except InferenceServerError as exc:
            raise grpc_error(exc) from None
        except Exception:
            # asyncio.CancelledError is a BaseException: it passes, as grpclib needs.
            logger.exception("gRPC %s failed", handler.__name__)
            raise grpc_error(InternalError(f"{handler.__name__} failed unexpectedly")) from None

    return wrapper  # type: ignore[return-value]


async def _receive(stream: Stream[Any, Any]) -> Any:
    """The one request message of a unary call."""
    message = await stream.recv_message()
    if message is None:  # the client ended the stream without sending one
        raise InvalidArgumentError("the call carried no request message")
    return message


def _unimplemented(rpc: str) -> Callable[[Any, Stream[Any, Any]], Awaitable[None]]:
    """A handler for an RPC of the protocol this server does not offer yet."""

    async def handler(self: Any, stream: Stream[Any, Any]) -> None:
        raise UnsupportedError(f"{rpc} is not supported by this server yet")

    handler.__name__ = handler.__qualname__ = rpc
    return _rpc(handler)


class InferenceService(grpc_service_grpc.GRPCInferenceServiceBase):  # type: ignore[misc]
    """``inference.GRPCInferenceService`` over a model repository."""

    def __init__(
        self,
        repository: ModelRepository,
        server_metadata: Mapping[str, Any],
        infer: Infer,
        stream_infer: StreamInfer,
    ) -> None:
        self._repository = repository
        self._server_metadata = server_metadata_message(server_metadata)  # never changes
        self._infer = infer
        self._stream_infer = stream_infer

    @_rpc
    async def ServerLive(self, stream: Stream[Any, Any]) -> None:
        await _receive(stream)
        await stream.send_message(pb.ServerLiveResponse(live=True))

    @_rpc
    async def ServerReady(self, stream: Stream[Any, Any]) -> None:
        await _receive(stream)
        await stream.send_message(pb.ServerReadyResponse(ready=self._repository.ready()))

    @_rpc
    async def ModelReady(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        # An unknown model is not ready, not an error (what Triton answers).
        ready = self._repository.model_ready(request.name, request.version)
        await stream.send_message(pb.ModelReadyResponse(ready=ready))

    @_rpc
    async def ServerMetadata(self, stream: Stream[Any, Any]) -> None:
        await _receive(stream)
        await stream.send_message(self._server_metadata)

    @_rpc
    async def ModelMetadata(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        served = self._repository.get(request.name, request.version)
        versions = self._repository.versions(request.name)
        await stream.send_message(model_metadata_message(served.model, versions))

    @_rpc
    async def ModelConfig(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        served = self._repository.get(request.name, request.version)
        await stream.send_message(model_config_message(served.model))

    @_rpc
    async def ModelInfer(self, stream: Stream[Any, Any]) -> None:
        message = await _receive(stream)
        served = self._repository.get(message.model_name, message.model_version)
        request = decode_request(message)
        response = await self._infer(served, request)
        await stream.send_message(encode_response(response))

    @_rpc
    async def ModelStreamInfer(self, stream: Stream[Any, Any]) -> None:
        await self._stream_infer(stream)

    # Later roadmap items (statistics, repository API, shared memory, trace,
    # logging). Each RPC must exist because the base class is abstract.
    ModelStatistics = _unimplemented("ModelStatistics")
    RepositoryIndex = _unimplemented("RepositoryIndex")
    RepositoryModelLoad = _unimplemented("RepositoryModelLoad")
    RepositoryModelUnload = _unimplemented("RepositoryModelUnload")
    SystemSharedMemoryStatus = _unimplemented("SystemSharedMemoryStatus")
    SystemSharedMemoryRegister = _unimplemented("SystemSharedMemoryRegister")
    SystemSharedMemoryUnregister = _unimplemented("SystemSharedMemoryUnregister")
    CudaSharedMemoryStatus = _unimplemented("CudaSharedMemoryStatus")
    CudaSharedMemoryRegister = _unimplemented("CudaSharedMemoryRegister")
    CudaSharedMemoryUnregister = _unimplemented("CudaSharedMemoryUnregister")
    TraceSetting = _unimplemented("TraceSetting")
    LogSettings = _unimplemented("LogSettings")


class HealthService(health_grpc.HealthBase):  # type: ignore[misc]
    """``grpc.health.v1.Health/Check``: SERVING when what was asked about is ready.

    ``service`` "" or "inference.GRPCInferenceService" asks about the whole server; a
    model name asks about that model (its latest version). An unknown name answers the
    NOT_FOUND status, as the gRPC health protocol specifies for unknown services.
    """

    def __init__(self, repository: ModelRepository) -> None:
        self._repository = repository

    @_rpc
    async def Check(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        service = request.service
        if service in _SERVER_SERVICES:
            ready = self._repository.ready()
        elif service in self._repository.names():
            ready = self._repository.model_ready(service)
        else:
            raise unknown_model(service)
        status = health_pb2.HealthCheckResponse
        await stream.send_message(status(status=status.SERVING if ready else status.NOT_SERVING))
