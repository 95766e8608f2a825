"""System (POSIX) shared-memory regions: open the object, check its size, map it.

A client creates a POSIX shared-memory object (``shm_open``, as
``tritonclient.utils.shared_memory`` does) and registers a window of it: ``key`` names
the object, ``offset`` and ``byte_size`` the window. On Linux the objects live in
``/dev/shm``; ``shm_open`` skips leading slashes and refuses any other slash, and so do
we, which also keeps a key from naming a file anywhere else.

The window is checked against ``fstat`` before it is mapped: a window that runs past the
end of its object would map without complaint and then fault (SIGBUS) on first access.
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


class SystemRegion(Region):
    kind = "system"

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.key = key
        self.offset = offset
        self._mmap, start = _map_window(name, key, offset, byte_size)
        # Every view handed out is a slice of this one. mmap refuses to close while
        # views of it exist (BufferError), so an input array a model still holds can
        # never point into unmapped memory: see ``_unmap``.
        self._view = memoryview(self._mmap)[start : start + byte_size]

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip

    def read_view(self, offset: int, byte_size: int) -> memoryview:
        """A read-only view of ``byte_size`` bytes at ``offset`` (checked by the caller)."""
        return self._view[offset : offset + byte_size].toreadonly()

    def write_target(self, offset: int, byte_size: int) -> np.ndarray[Any, Any]:
        """The bytes at ``offset`` as a writable uint8 array, to copy an output into."""
        return np.frombuffer(self._view[offset : offset + byte_size], dtype=np.uint8)

    def _unmap(self) -> None:
        self._view.release()
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


def _map_window(name: str, key: str, offset: int, byte_size: int) -> tuple[mmap.mmap, int]:
    """Map ``[offset, offset + byte_size)`` of object ``key``; the window's start in the map."""
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
        return mapping, start
    finally:
        os.close(fd)


def _object_name(key: str) -> str:
    """The object's file name in /dev/shm, by shm_open's rules; INVALID_ARG otherwise."""
    name = key.lstrip("/")
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise InvalidArgumentError(f"invalid shared memory key '{key}'")
    return name
