"""System (POSIX) and CUDA shared-memory regions, owned by a server instance.

``SharedMemoryRegistry`` holds the registered regions; ``RequestRegions`` is one
request's use of them (leases, inputs read, outputs written). The front ends call
``shared_memory_input`` / ``shared_memory_outputs`` while decoding a request, then
``RequestRegions.read_device_inputs`` when it has ``device_inputs``, and
``RequestRegions.write_outputs`` (``write_device_outputs`` when it has
``device_outputs``) before encoding its response. Device work runs in worker threads.
"""

from ._cuda import is_device_array
from ._region import Kind
from ._registry import SharedMemoryRegistry
from ._tensors import (
    RequestRegions,
    is_shared_memory_output,
    shared_memory_input,
    shared_memory_outputs,
)

__all__ = [
    "Kind",
    "RequestRegions",
    "SharedMemoryRegistry",
    "is_device_array",
    "is_shared_memory_output",
    "shared_memory_input",
    "shared_memory_outputs",
]
