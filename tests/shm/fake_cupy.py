"""A stand-in for cupy with device memory modelled on the host, so that CUDA shared memory
runs end to end where there is no GPU.

The ``fake_cupy`` fixture (``conftest.py``) loads this file as the module ``cupy``. It
offers the calls ``trioserve.shm._cuda`` makes, with cupy's signatures, and what a client
process does with memory of its own: ``runtime.malloc`` and ``runtime.ipcGetMemHandle``,
and ``write`` / ``read`` in place of its memcpy calls. Each loaded copy has its own
memory and its own record.

Every call that would wait on a real device (opening and closing IPC handles, copies to,
from and between device memory) is recorded in ``calls`` with the thread it ran on.
Kernels (``*``, ``astype``) run where a model runs them and are not recorded.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from typing import Any

import numpy

uint8 = numpy.uint8

device_count = 1
# (call, thread ident) for each call that would wait on the device, in order.
calls: list[tuple[str, int]] = []
# Once ``hold_opens`` made it, ipcOpenMemHandle sets ``open_waiting`` and waits for it.
_open_gate: threading.Event | None = None
open_waiting = threading.Event()
GATE_TIMEOUT_S = 10  # a server that blocks its own event loop in the call never gets past

# Each allocation, and each mapping of an opened handle, starts at its own address, 4 GiB
# from the next, so an address inside one is never inside another.
_FIRST_ADDRESS = 0x7F00_0000_0000
_STRIDE = 1 << 32
_addresses = itertools.count(_FIRST_ADDRESS, _STRIDE)
_memory: dict[int, numpy.ndarray[Any, Any]] = {}  # start address -> its bytes
_exported: dict[bytes, int] = {}  # IPC handle -> the address of the allocation it names
_opened: set[int] = set()  # addresses of mappings that ipcOpenMemHandle made
_current = threading.local()  # the current device of each thread


class CUDARuntimeError(RuntimeError):
    pass


def _record(call: str) -> None:
    calls.append((call, threading.get_ident()))


def _bytes_at(address: int, size: int) -> numpy.ndarray[Any, Any]:
    start = address - (address - _FIRST_ADDRESS) % _STRIDE
    memory = _memory.get(start)
    if memory is None or address - start + size > memory.size:
        raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    return memory[address - start : address - start + size]


def _allocate(size: int) -> int:
    address = next(_addresses)
    _memory[address] = numpy.zeros(size, dtype=uint8)
    return address


class runtime:  # cupy.cuda.runtime is a module
    CUDARuntimeError = CUDARuntimeError

    @staticmethod
    def getDeviceCount() -> int:
        return device_count

    @staticmethod
    def malloc(size: int) -> int:
        return _allocate(size)

    @staticmethod
    def ipcGetMemHandle(address: int) -> bytes:
        handle = b"fake-ipc" + address.to_bytes(8, "little") + bytes(48)
        _exported[handle] = address
        return handle

    @staticmethod
    def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
        _record("ipcOpenMemHandle")
        if _open_gate is not None:
            open_waiting.set()
            if not _open_gate.wait(GATE_TIMEOUT_S):
                raise CUDARuntimeError("the test never opened the gate")
        exported = _exported.get(bytes(handle))
        if exported is None:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle: invalid resource handle")
        mapping = next(_addresses)
        _memory[mapping] = _memory[exported]  # the same bytes, at an address of this process
        _opened.add(mapping)
        return mapping

    @staticmethod
    def ipcCloseMemHandle(address: int) -> None:
        _record("ipcCloseMemHandle")
        if address not in _opened:
            raise CUDARuntimeError("cudaErrorInvalidValue: invalid argument")
        _opened.remove(address)
        del _memory[address]


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device
        self._previous: list[int] = []

    def __enter__(self) -> Device:
        if not 0 <= self.id < device_count:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        self._previous.append(getattr(_current, "device", 0))
        _current.device = self.id
        return self

    def __exit__(self, *exc_info: object) -> None:
        _current.device = self._previous.pop()


class UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: object, device_id: int = 0) -> None:
        self.ptr = ptr
        self.size = size
        self.owner = owner  # kept alive as long as the memory is
        self.device_id = device_id


class _OwnedMemory:
    """Device memory of an array that cupy allocated: freed with the last array over it."""

    def __init__(self, size: int) -> None:
        self.ptr = _allocate(size)
        self.size = size
        weakref.finalize(self, _memory.pop, self.ptr)


class MemoryPointer:
    def __init__(self, mem: Any, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset


class ndarray:  # cupy's name
    def __init__(
        self, shape: int | tuple[int, ...], dtype: Any = float, memptr: MemoryPointer | None = None
    ) -> None:
        self.shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.dtype = numpy.dtype(dtype)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self.data = memptr or MemoryPointer(_OwnedMemory(self.nbytes), 0)

    def _host_view(self) -> numpy.ndarray[Any, Any]:
        """The memory seen from the host: how the fake itself reaches it, no device call."""
        view: numpy.ndarray[Any, Any] = _bytes_at(self.data.ptr, self.nbytes).view(self.dtype)
        return view.reshape(self.shape)

    def get(
        self, stream: object = None, order: str = "C", out: numpy.ndarray[Any, Any] | None = None
    ) -> numpy.ndarray[Any, Any]:
        _record("get")
        if out is None:
            return self._host_view().copy()
        if out.shape != self.shape or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError("out must be a C-contiguous array of the same shape and dtype")
        out[...] = self._host_view()
        return out

    def set(self, arr: numpy.ndarray[Any, Any], stream: object = None) -> None:
        _record("set")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError("Shape mismatch" if arr.shape != self.shape else "dtype mismatch")
        self._host_view()[...] = arr

    def reshape(self, *shape: int) -> ndarray:
        return ndarray(self._host_view().reshape(shape).shape, self.dtype, self.data)

    def view(self, dtype: Any) -> ndarray:
        return ndarray(self._host_view().view(dtype).shape, dtype, self.data)

    def astype(self, dtype: Any) -> ndarray:
        return _from_host(self._host_view().astype(dtype))

    def __mul__(self, other: Any) -> ndarray:
        return _from_host(self._host_view() * other)

    __rmul__ = __mul__

    def __array__(self, *args: object, **kwargs: object) -> numpy.ndarray[Any, Any]:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly."
        )


def _from_host(values: numpy.ndarray[Any, Any]) -> ndarray:
    result = ndarray(values.shape, values.dtype)
    result._host_view()[...] = values
    return result


def asarray(a: numpy.ndarray[Any, Any]) -> ndarray:
    _record("asarray")  # host to device
    return _from_host(a)


def copyto(dst: ndarray, src: ndarray) -> None:
    _record("copyto")
    numpy.copyto(dst._host_view(), src._host_view())


def ascontiguousarray(a: ndarray) -> ndarray:
    return a  # every array here is C-contiguous


class cuda:  # cupy.cuda is a module
    runtime = runtime
    Device = Device
    UnownedMemory = UnownedMemory
    MemoryPointer = MemoryPointer


# --- what the client process does with its own device memory -------------------------


def write(address: int, data: bytes) -> None:
    """Host to device, as the client's memcpy would: not a call of the server's."""
    _bytes_at(address, len(data))[:] = numpy.frombuffer(data, dtype=uint8)


def read(address: int, size: int) -> bytes:
    """Device to host, as the client's memcpy would: not a call of the server's."""
    return _bytes_at(address, size).tobytes()


def hold_opens() -> threading.Event:
    """From now on, ipcOpenMemHandle sets ``open_waiting`` and then waits until the Event
    returned is set (failing after GATE_TIMEOUT_S)."""
    global _open_gate
    _open_gate = threading.Event()
    return _open_gate


def open_handles() -> int:
    """How many opened IPC handles are not closed yet."""
    return len(_opened)
