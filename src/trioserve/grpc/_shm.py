"""The shared-memory RPCs: SystemSharedMemory* and CudaSharedMemory*.

Each RPC is a function from the registry and the request message to the reply message;
``_methods`` checks the restriction first. They answer at once, except CUDA
registration, which opens the handle in one of trio's worker threads. A restricted call
without the expected metadata answers UNAVAILABLE, as Triton's restricted protocols do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from google.protobuf.message import Message

from .._errors import UnavailableError
from .._restricted import Restriction
from ..shm import Kind, SharedMemoryRegistry
from ._generated import grpc_service_pb2 as pb

_Answer = Callable[[SharedMemoryRegistry, Any], Awaitable[Message]]


def check_restriction(restriction: Restriction | None, metadata: Mapping[str, str]) -> None:
    """UNAVAILABLE unless the call carries the restricted group's header, if it has one."""
    if restriction is None:
        return
    if not restriction.allows(metadata.get(restriction.key)):
        raise UnavailableError(restriction.message())


def _status(kind: Kind, reply_type: Any) -> _Answer:
    """The status RPC of one kind of region: every region's status, keyed by its name."""

    async def status(registry: SharedMemoryRegistry, request: Any) -> Message:
        reply = reply_type()
        for region in registry.status(kind, request.name):
            reply.regions[region["name"]].CopyFrom(reply_type.RegionStatus(**region))
        return reply

    return status


async def _system_register(registry: SharedMemoryRegistry, request: Any) -> Message:
    registry.register_system(request.name, request.key, request.offset, request.byte_size)
    return pb.SystemSharedMemoryRegisterResponse()


async def _system_unregister(registry: SharedMemoryRegistry, request: Any) -> Message:
    registry.unregister("system", request.name)
    return pb.SystemSharedMemoryUnregisterResponse()


async def _cuda_register(registry: SharedMemoryRegistry, request: Any) -> Message:
    await registry.register_cuda(
        request.name, request.raw_handle, request.device_id, request.byte_size
    )
    return pb.CudaSharedMemoryRegisterResponse()


async def _cuda_unregister(registry: SharedMemoryRegistry, request: Any) -> Message:
    registry.unregister("cuda", request.name)
    return pb.CudaSharedMemoryUnregisterResponse()


SHARED_MEMORY_RPCS: dict[str, _Answer] = {
    "SystemSharedMemoryStatus": _status("system", pb.SystemSharedMemoryStatusResponse),
    "SystemSharedMemoryRegister": _system_register,
    "SystemSharedMemoryUnregister": _system_unregister,
    "CudaSharedMemoryStatus": _status("cuda", pb.CudaSharedMemoryStatusResponse),
    "CudaSharedMemoryRegister": _cuda_register,
    "CudaSharedMemoryUnregister": _cuda_unregister,
}
