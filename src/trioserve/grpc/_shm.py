"""The shared-memory RPCs: SystemSharedMemory* and CudaSharedMemory*.

Each RPC is a plain function from the registry and the request message to the reply
message; ``_service`` receives, checks the restriction and sends. A restricted call
without the expected metadata answers UNAVAILABLE, as Triton's restricted protocols do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._errors import UnavailableError
from .._restricted import Restriction
from ..shm import SharedMemoryRegistry
from ._generated import grpc_service_pb2 as pb


def check_restriction(restriction: Restriction | None, metadata: Mapping[str, Any]) -> None:
    """UNAVAILABLE unless the call carries the restricted group's header, if it has one."""
    if restriction is None:
        return
    value = metadata.get(restriction.key)
    if not restriction.allows(value if isinstance(value, str) else None):
        raise UnavailableError(restriction.message())


def _system_status(registry: SharedMemoryRegistry, request: Any) -> Any:
    reply = pb.SystemSharedMemoryStatusResponse()
    for status in registry.status("system", request.name):
        reply.regions[status["name"]].CopyFrom(
            pb.SystemSharedMemoryStatusResponse.RegionStatus(**status)
        )
    return reply


def _system_register(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.register_system(request.name, request.key, request.offset, request.byte_size)
    return pb.SystemSharedMemoryRegisterResponse()


def _system_unregister(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.unregister("system", request.name)
    return pb.SystemSharedMemoryUnregisterResponse()


def _cuda_status(registry: SharedMemoryRegistry, request: Any) -> Any:
    reply = pb.CudaSharedMemoryStatusResponse()
    for status in registry.status("cuda", request.name):
        reply.regions[status["name"]].CopyFrom(
            pb.CudaSharedMemoryStatusResponse.RegionStatus(**status)
        )
    return reply


def _cuda_register(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
    return pb.CudaSharedMemoryRegisterResponse()


def _cuda_unregister(registry: SharedMemoryRegistry, request: Any) -> Any:
    registry.unregister("cuda", request.name)
    return pb.CudaSharedMemoryUnregisterResponse()


SHARED_MEMORY_RPCS: dict[str, Callable[[SharedMemoryRegistry, Any], Any]] = {
    "SystemSharedMemoryStatus": _system_status,
    "SystemSharedMemoryRegister": _system_register,
    "SystemSharedMemoryUnregister": _system_unregister,
    "CudaSharedMemoryStatus": _cuda_status,
    "CudaSharedMemoryRegister": _cuda_register,
    "CudaSharedMemoryUnregister": _cuda_unregister,
}
