"""The handlers of ``inference.GRPCInferenceService`` and ``grpc.health.v1.Health``.

Handlers run on the asyncio side of the bridge (grpclib is asyncio code) and never touch
trio themselves: what must run in trio, ``ServedModel.infer``, a whole ModelStreamInfer
call, and the shared-memory work that waits on a device in trio's worker threads (CUDA
registration, copies to and from a GPU), goes through the ``Infer``, ``StreamInfer`` and
``InTrio`` callables the bridge hands in. Everything else they read (readiness,
metadata, config) is plain synchronous state of the repository; the load reporter only
reads trio's clock, which this thread's trio run answers.

Each handler body is wrapped by ``_rpc``, the one place that turns failures into gRPC
statuses: an ``InferenceServerError`` through the table in ``_errors``, anything else
into INTERNAL (logged, since it is a bug of ours).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar, TypeVarTuple

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
from .._restricted import Restriction
from .._types import InferenceRequest, InferenceResponse
from ..metrics._orca import LoadReporter
from ..shm import RequestRegions, SharedMemoryRegistry
from ._codec import (
    decode_request,
    encode_response,
    model_config_message,
    model_metadata_message,
    server_metadata_message,
    statistics_message,
)
from ._errors import grpc_error
from ._generated import grpc_service_grpc, health_grpc, health_pb2
from ._generated import grpc_service_pb2 as pb
from ._orca import load_report_trailer
from ._repository_rpcs import REPOSITORY_RPCS
from ._shm import SHARED_MEMORY_RPCS, check_restriction

logger = logging.getLogger("trioserve.grpc")

# Runs ``served.infer(request)`` where it must run (in trio) and awaits it from asyncio.
# Cancelling the await must cancel the call: that is how a client's disconnect or
# deadline withdraws a queued request.
Infer = Callable[[ServedModel, InferenceRequest], Awaitable[InferenceResponse]]
# Serves one ModelStreamInfer call in trio (``_stream.StreamInfer``), awaited from asyncio.
# It returns the model the call last asked for.
StreamInfer = Callable[[Stream[Any, Any]], Awaitable[ServedModel | None]]

_Args = TypeVarTuple("_Args")
_Result = TypeVar("_Result")


class InTrio(Protocol):
    """Runs ``await function(*args)`` in trio and awaits it from asyncio. Cancelling the
    await cancels the call, and the await ends only once the call has: what the call
    uses (a request's leased regions) stays valid throughout."""

    def __call__(
        self, function: Callable[[*_Args], Awaitable[_Result]], /, *args: *_Args
    ) -> Awaitable[_Result]: ...


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


def _shared_memory_rpc(rpc: str) -> Callable[[Any, Stream[Any, Any]], Awaitable[None]]:
    """A handler for one of the shared-memory RPCs (``_shm.SHARED_MEMORY_RPCS``)."""
    answer = SHARED_MEMORY_RPCS[rpc]

    async def handler(self: InferenceService, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        check_restriction(self._shared_memory_restriction, stream.metadata or {})
        await stream.send_message(await answer(self._shared_memory, request, self._in_trio))

    handler.__name__ = handler.__qualname__ = rpc
    return _rpc(handler)


def _repository_rpc(rpc: str) -> Callable[[Any, Stream[Any, Any]], Awaitable[None]]:
    """A handler for one of the repository RPCs (``_repository_rpcs.REPOSITORY_RPCS``)."""
    answer = REPOSITORY_RPCS[rpc]

    async def handler(self: InferenceService, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        check_restriction(self._repository_restriction, stream.metadata or {})
        await stream.send_message(await answer(self._repository, request, self._in_trio))

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
        in_trio: InTrio,
        *,
        shared_memory: SharedMemoryRegistry | None = None,
        restrictions: Mapping[str, Restriction] | None = None,
        load: LoadReporter | None = None,
    ) -> None:
        """What the server owns is passed in (shared with the REST front end); a service
        built without it gets its own."""
        self._repository = repository
        self._server_metadata = server_metadata_message(server_metadata)  # never changes
        self._infer = infer
        self._stream_infer = stream_infer
        self._in_trio = in_trio
        self._shared_memory = shared_memory or SharedMemoryRegistry()
        self._shared_memory_restriction = (restrictions or {}).get("shared-memory")
        self._repository_restriction = (restrictions or {}).get("model-repository")
        self._load = load or LoadReporter()  # the server's, shared with the REST front end

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
        with RequestRegions(self._shared_memory, served.model.device) as regions:
            request = decode_request(message, regions)
            if regions.device_inputs:
                await self._in_trio(regions.read_device_inputs)
            with self._load.counting(served):
                response = await self._infer(served, request)
                if regions.device_outputs:
                    await self._in_trio(regions.write_device_outputs, response)
                else:
                    regions.write_outputs(response)
            await stream.send_message(encode_response(response))
        await self._send_load_report(stream, served)

    async def _send_load_report(self, stream: Stream[Any, Any], served: ServedModel) -> None:
        """The ORCA trailer, when the call's metadata asks for one."""
        trailer = load_report_trailer(stream.metadata, self._load, served)
        if trailer is not None:
            await stream.send_trailing_metadata(metadata=trailer)

    SystemSharedMemoryStatus = _shared_memory_rpc("SystemSharedMemoryStatus")
    SystemSharedMemoryRegister = _shared_memory_rpc("SystemSharedMemoryRegister")
    SystemSharedMemoryUnregister = _shared_memory_rpc("SystemSharedMemoryUnregister")
    CudaSharedMemoryStatus = _shared_memory_rpc("CudaSharedMemoryStatus")
    CudaSharedMemoryRegister = _shared_memory_rpc("CudaSharedMemoryRegister")
    CudaSharedMemoryUnregister = _shared_memory_rpc("CudaSharedMemoryUnregister")

    @_rpc
    async def ModelStatistics(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        stats = self._repository.statistics(request.name, request.version)
        await stream.send_message(statistics_message(stats))

    @_rpc
    async def ModelStreamInfer(self, stream: Stream[Any, Any]) -> None:
        served = await self._stream_infer(stream)
        if served is not None:
            await self._send_load_report(stream, served)

    # Later roadmap items (repository API, trace, logging). Each RPC must exist
    # because the base class is abstract.
    RepositoryIndex = _repository_rpc("RepositoryIndex")
    RepositoryModelLoad = _repository_rpc("RepositoryModelLoad")
    RepositoryModelUnload = _repository_rpc("RepositoryModelUnload")
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
