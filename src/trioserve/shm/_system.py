"""System (POSIX) shared-memory regions: open the object, check its size, map it.

A client creates a POSIX shared-memory object (``shm_open``, as
``tritonclient.utils.shared_memory`` does) and registers a window of it: ``key`` names
the object, ``offset`` and ``byte_size`` the window. On Linux the objects live in
``/dev/shm``; ``shm_open`` skips leading slashes and refuses any other slash, and so do
we, which also keeps a key from naming a file anywhere else.

The window is checked against ``fstat`` before it is mapped: a window that runs past the
end of its object would map without complaint and then fault (SIGBUS) on first access.

Any process that can write the object can also truncate it *after* registration, and a
page of a mapping that now lies past the end of its file faults on access: SIGBUS, which
kills the server (Python cannot recover from it). Unlinking or replacing the object is
harmless (our descriptor keeps the old one alive); only shrinking it is dangerous. So:

- Before every access the region keeps its descriptor and ``fstat``s it (a syscall of
  about a microsecond): a file now shorter than the span refuses the request with
  INVALID_ARG and marks the region bad, and every later request that names it is
  refused the same way until it is unregistered. Sound regions keep zero-copy inputs.
- Outputs are written with ``pwrite`` on that descriptor, not through the mapping:
  writing past the end of a file extends it rather than faulting, so an output write
  cannot fault whatever happens meanwhile. (The client's shared mapping sees the bytes,
  both being the same pages.)
- What remains: an input is a view of the mapping that the model reads after the check.
  A truncation between the check and the model's reads (a window of one request's run)
  still faults. Closing it would cost a copy of every input, which is what zero-copy
  shared memory is there to avoid; the process able to do it is one the operator gave
  write access to the server's shared-memory objects.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import stat
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError
from ._region import Region

SHM_DIRECTORY = "/dev/shm"
_NAME_MAX = 255  # the longest file name, as shm_open allows (NAME_MAX)


class SystemRegion(Region):
    kind = "system"

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.key = key
        self.offset = offset
        self._fd, self._mmap, start = _map_window(name, key, offset, byte_size)
        self._fault: str | None = None  # why the region is bad, once its file shrank
        # Every view handed out is a slice of this one. mmap refuses to close while
        # views of it exist (BufferError), so an input array a model still holds can
        # never point into unmapped memory: see ``_unmap``.
        self._view = memoryview(self._mmap)[start : start + byte_size]

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip

    def read_view(self, offset: int, byte_size: int, what: str) -> memoryview:
        """A read-only view of ``byte_size`` bytes at ``offset`` (checked by the caller)."""
        self.check_backed(offset + byte_size, what)
        return self._view[offset : offset + byte_size].toreadonly()

    def write(self, offset: int, raw: np.ndarray[Any, Any]) -> None:
        """Write the uint8 array ``raw`` at ``offset`` (checked by the caller with
        ``check_span`` and ``check_backed``) with pwrite, which cannot fault."""
        data = np.ascontiguousarray(raw).data.cast("B")
        position = self.offset + offset
        while data:  # pwrite may write less than asked, as any write
            written = os.pwrite(self._fd, data, position)
            data, position = data[written:], position + written

    def check_backed(self, end: int, what: str) -> None:
        """INVALID_ARG, and the region marked bad, unless the file still holds the
        region's bytes up to ``end``: a mapped page past the end of the file faults."""
        if self._fault is None:
            size = os.fstat(self._fd).st_size
            if size < self.offset + end:
                self._fault = (
                    f"shared memory region '{self.name}' is no longer usable: its object "
                    f"'{self.key}' shrank to {size} bytes after registration"
                )
        if self._fault is not None:
            raise InvalidArgumentError(f"{what}: {self._fault}")

    def _unmap(self) -> None:
        self._view.release()
        os.close(self._fd)
        try:
            self._mmap.close()
        except BufferError:
            # Arrays over the region are still alive. They may only be waiting in garbage
            # that a reference cycle keeps (a failed request's traceback): collect it.
            # Unregistering is rare enough to afford that.
            gc.collect()
            # Otherwise a model kept an array: the mapping goes when the last such array
            # does, never before.
            with contextlib.suppress(BufferError):
                self._mmap.close()


def _map_window(name: str, key: str, offset: int, byte_size: int) -> tuple[int, mmap.mmap, int]:
    """Map ``[offset, offset + byte_size)`` of object ``key``: the open descriptor (which the
    region keeps, to check and write through), the map, the window's start in the map."""
    path = os.path.join(SHM_DIRECTORY, _object_name(key))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgumentError(
            f"failed to register shared memory region '{name}': unable to open shared "
            f"memory object '{key}': {exc.strerror}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgumentError(
                f"failed to register shared memory region '{name}': '{key}' is not a "
                "shared memory object"
            )
        if offset + byte_size > info.st_size:
            raise InvalidArgumentError(
                f"failed to register shared memory region '{name}': offset {offset} + "
                f"byte_size {byte_size} exceeds the {info.st_size} bytes of shared memory "
                f"object '{key}'"
            )
        # mmap offsets must be multiples of the allocation granularity: map from the
        # boundary below ``offset`` and start the window inside the map.
        start = offset % mmap.ALLOCATIONGRANULARITY
        try:
            mapping = mmap.mmap(fd, start + byte_size, offset=offset - start)
        except OSError as exc:
            raise InvalidArgumentError(
                f"failed to register shared memory region '{name}': {exc.strerror}"
            ) from None
        return fd, mapping, start
    except BaseException:
        os.close(fd)
        raise


def _object_name(key: str) -> str:
    """The object's file name in /dev/shm, by shm_open's rules; INVALID_ARG otherwise."""
    name = key.lstrip("/")
    if not name or "/" in name or "\0" in name or name in (".", "..") or _size(name) < 0:
        raise InvalidArgumentError(f"invalid shared memory key '{key[:_NAME_MAX]}'")
    if _size(name) > _NAME_MAX:  # refused here rather than by open (ENAMETOOLONG)
        raise InvalidArgumentError(
            f"invalid shared memory key '{key[:64]}...': longer than {_NAME_MAX} bytes"
        )
    return name


def _size(name: str) -> int:
    """The file name's length in bytes; -1 for a name no file can have (a lone surrogate)."""
    try:
        return len(name.encode())
    except UnicodeEncodeError:
        return -1
