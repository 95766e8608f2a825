"""CUDA shared-memory regions, opened from a client's cudaIpcMemHandle with cupy.

cupy is the optional ``gpu`` extra. Without it, or without a usable device, the server
still serves: CUDA status answers an empty list, registering answers UNAVAILABLE with
the reason, and server metadata does not list ``cuda_shared_memory``.

cupy calls used (its documented API): ``cuda.runtime.getDeviceCount``,
``cuda.runtime.ipcOpenMemHandle`` / ``ipcCloseMemHandle``, ``cuda.Device`` as a context,
``cuda.UnownedMemory`` + ``cuda.MemoryPointer`` + ``ndarray(memptr=...)`` for views of
the opened memory, ``ndarray.get`` / ``ndarray.set`` / ``copyto`` for copies.

Opening a handle and copying to, from or between regions wait on the device, so callers
run them in a worker thread (``trio.to_thread``), as they run models: the event loop
only makes views of the memory.
"""

from __future__ import annotations

import importlib
import weakref
from functools import cache
from types import ModuleType
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError, UnavailableError
from .._tensor import DATATYPES, Datatype
from ._region import Region

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


@cache
def _cupy_or_reason() -> ModuleType | str:
    """cupy when it imports and sees a device, else why not (checked once per process:
    the answer cannot change while it runs)."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as exc:
        return f"cupy is not installed (install trioserve[gpu]): {exc}"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # cupy raises CUDARuntimeError without a driver
        return f"no CUDA device is usable: {exc}"
    return cupy if count > 0 else "no CUDA device is present"


def cuda_unavailable_reason() -> str | None:
    """None when CUDA shared memory can work here, else the reason it cannot."""
    found = _cupy_or_reason()
    return found if isinstance(found, str) else None


def _cupy() -> Any:
    found = _cupy_or_reason()
    if isinstance(found, str):
        raise UnavailableError(f"CUDA shared memory is not available: {found}")
    return found


class CudaRegion(Region):
    kind = "cuda"

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        cupy = _cupy()
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise InvalidArgumentError(
                f"failed to register CUDA shared memory region '{name}': raw_handle must be "
                f"a {IPC_HANDLE_BYTES}-byte cudaIpcMemHandle_t, got {len(raw_handle)} bytes"
            )
        count = int(cupy.cuda.runtime.getDeviceCount())
        if not 0 <= device_id < count:
            raise InvalidArgumentError(
                f"failed to register CUDA shared memory region '{name}': device_id "
                f"{device_id} is not one of the {count} devices"
            )
        self.device_id = device_id
        try:
            with cupy.cuda.Device(device_id):
                pointer = int(cupy.cuda.runtime.ipcOpenMemHandle(raw_handle))
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise InvalidArgumentError(
                f"failed to register CUDA shared memory region '{name}': {exc}"
            ) from None
        # Every cupy array over the region keeps ``opened`` alive (it owns the memory);
        # the handle is closed when the last of them and the region itself let go, so an
        # array a model still holds never points at closed memory.
        opened = _OpenedHandle()
        weakref.finalize(opened, _close_handle, pointer, device_id)
        self._memory: Any = cupy.cuda.UnownedMemory(pointer, byte_size, opened, device_id)

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}

    def device_array(
        self, dt: Datatype, shape: tuple[int, ...], offset: int, byte_size: int
    ) -> Any:
        """A cupy array over the region's memory at ``offset`` (no copy)."""
        cupy = _cupy()
        pointer = cupy.cuda.MemoryPointer(self._memory, offset)
        with cupy.cuda.Device(self.device_id):
            if dt.is_bytes:
                return cupy.ndarray((byte_size,), dtype=np.uint8, memptr=pointer)
            return cupy.ndarray(shape, dtype=dt.dtype, memptr=pointer)

    def read_into(self, offset: int, host: np.ndarray[Any, Any]) -> None:
        """Copy the ``host.nbytes`` bytes at ``offset`` into the uint8 array ``host`` (for
        models that run on the CPU). Blocks until the copy is done: call it off the loop."""
        raw = self.device_array(DATATYPES["UINT8"], (host.nbytes,), offset, host.nbytes)
        with _cupy().cuda.Device(self.device_id):
            raw.get(out=host)

    def write(self, offset: int, data: Any, byte_size: int) -> None:
        """Copy ``byte_size`` raw bytes (a numpy or cupy uint8 array) to ``offset``. Blocks
        until the copy is done: call it off the loop."""
        cupy = _cupy()
        target = self.device_array(DATATYPES["UINT8"], (byte_size,), offset, byte_size)
        with cupy.cuda.Device(self.device_id):
            if isinstance(data, cupy.ndarray):
                cupy.copyto(target, data)  # device to device
            else:
                target.set(np.ascontiguousarray(data))

    def _release(self) -> None:
        self._memory = None  # the handle closes once no array uses it any more


class _OpenedHandle:
    """Stands for an opened IPC handle; its finalizer closes the handle."""


def _close_handle(pointer: int, device_id: int) -> None:
    cupy = _cupy()
    with cupy.cuda.Device(device_id):
        cupy.cuda.runtime.ipcCloseMemHandle(pointer)


def is_device_array(array: Any) -> bool:
    """Whether ``array`` lives on a GPU (a cupy array), without importing cupy."""
    return type(array).__module__.startswith("cupy")


def device_bytes(array: Any) -> Any:
    """A cupy array's contiguous raw bytes as a flat uint8 cupy array."""
    cupy = _cupy()
    return cupy.ascontiguousarray(array).reshape(-1).view(cupy.uint8)


def to_host(array: Any) -> np.ndarray[Any, Any]:
    """A cupy array's contents, copied to the host."""
    host: np.ndarray[Any, Any] = array.get()
    return host
