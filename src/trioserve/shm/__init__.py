"""System (POSIX) and CUDA shared-memory regions, owned by a server instance.

``SharedMemoryRegistry`` holds the registered regions; ``RequestRegions`` is one
request's use of them (leases, inputs read, outputs written). The front ends call
``shared_memory_input`` / ``shared_memory_outputs`` while decoding a request, then
``RequestRegions.read_inputs_off_loop`` when it has ``inputs_off_loop``, and
``RequestRegions.write_outputs`` (``write_outputs_off_loop`` when it has
``outputs_off_loop``) before encoding its response. Device work and large copies run in
worker threads.
"""

from ._cuda import is_device_array
from ._region import Kind
from ._registry import SharedMemoryRegistry
from ._system import OutputWindow, WindowInput
from ._tensors import (
    RequestRegions,
    is_shared_memory_output,
    shared_memory_input,
    shared_memory_outputs,
)

__all__ = [
    "Kind",
    "OutputWindow",
    "RequestRegions",
    "SharedMemoryRegistry",
    "WindowInput",
    "is_device_array",
    "is_shared_memory_output",
    "shared_memory_input",
    "shared_memory_outputs",
]
