"""System (POSIX) shared-memory regions: open the object, check its size, copy through it.

A client creates a POSIX shared-memory object (``shm_open``, as
``tritonclient.utils.shared_memory`` does) and registers a window of it: ``key`` names
the object, ``offset`` and ``byte_size`` the window. On Linux the objects live in
``/dev/shm``; ``shm_open`` skips leading slashes and refuses any other slash, and so do
we, which also keeps a key from naming a file anywhere else. A registration is checked
against the object's size (``fstat``), so a window past its end is refused at once.

Any process that can write the object can also truncate it at any time, and a page of a
mapping that then lies past the end of its file faults on access: SIGBUS, which kills the
server (Python cannot recover from it). (Unlinking or replacing the object does no harm:
the region's descriptor keeps the object it registered.) No check of the size before an access closes
that: the truncation may come between the check and the access, or while a model reads
its input. So the server never maps a system region. It keeps the object's descriptor
(one per region) and copies through it with calls that cannot fault:

- An input is read with ``preadv`` straight into the tensor's own new buffer. A read
  that meets the end of the file returns fewer bytes: the request is refused with
  INVALID_ARG naming the region. The model gets the copy, which nothing can take away.
- An output is written with ``pwrite`` straight from the tensor's buffer, once
  ``fstat`` shows that the object still holds its window (else INVALID_ARG, before any
  output is written). A write cannot fault: past the end of a file it extends it, so
  an object shrunk between the check and the write grows back to at most the end of
  the window. (The client's mapping sees the bytes: both are the same pages.)
- A shrunk object is no state of the region: each access is judged by the bytes it
  finds, so once the client grows the object back, the region serves again.

Inputs cost a copy for that, about as much CPU as writing the output: a 16 MiB round
trip takes about twice the CPU it took with inputs read in place from a mapping.
Zero-copy would need an object that provably cannot shrink while it is read, and a
POSIX shared-memory object never is: seals (``F_SEAL_SHRINK``) exist only for memfd
objects (tmpfs refuses ``F_ADD_SEALS`` on an ``shm_open`` file with EPERM), a lease
cannot be taken on a file another process holds open for writing (as the client does),
and a truncation discards even the private copies of a ``MAP_PRIVATE`` mapping.
"""

from __future__ import annotations

import itertools
import os
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError
from ..ipc._windows import holds, read_window, shrunk_message, write_window
from ._region import Region

SHM_DIRECTORY = "/dev/shm"
_NAME_MAX = 255  # the longest file name, as shm_open allows (NAME_MAX)
_serials = itertools.count(1)


class SystemRegion(Region):
    kind = "system"

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        super().__init__(name, byte_size)
        self.key = key
        self.offset = offset
        self._fd = _open_window(name, key, offset, byte_size)
        # Which region this is, never reused: an instance process that was handed the
        # descriptor knows the region by it (a name can be registered again).
        self.serial = next(_serials)

    @property
    def descriptor(self) -> int:
        """The object's descriptor: open until the region is released."""
        return self._fd

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size}  # fmt: skip

    def read_into(self, offset: int, buffer: np.ndarray[Any, Any], what: str) -> None:
        """Fill the uint8 array ``buffer`` with the region's bytes at ``offset`` (checked by
        the caller with ``check_span``); INVALID_ARG if the object no longer holds them."""
        view = buffer.data.cast("B")
        if not read_window(self._fd, self.offset + offset, view):
            raise self._shrunk(offset, len(view), what)

    def check_holds(self, offset: int, byte_size: int, what: str) -> None:
        """INVALID_ARG unless the object still holds the region's ``byte_size`` bytes at
        ``offset``: an output is refused before anything is written."""
        if not holds(self._fd, self.offset + offset + byte_size):
            raise self._shrunk(offset, byte_size, what)

    def write(self, offset: int, raw: np.ndarray[Any, Any]) -> None:
        """Write the uint8 array ``raw`` at ``offset`` (checked by the caller with
        ``check_span`` and ``check_holds``) with pwrite, which cannot fault."""
        write_window(self._fd, self.offset + offset, np.ascontiguousarray(raw).data.cast("B"))

    def _shrunk(self, offset: int, byte_size: int, what: str) -> InvalidArgumentError:
        return InvalidArgumentError(shrunk_message(what, self.name, self.key, offset, byte_size))

    def _release(self) -> None:
        os.close(self._fd)


def _open_window(name: str, key: str, offset: int, byte_size: int) -> int:
    """A descriptor of object ``key``, which holds ``[offset, offset + byte_size)`` now."""
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
        return fd
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


class WindowInput(np.ndarray[Any, Any]):
    """An input left in its client's system region, for a model whose instance process
    reads it from there itself (``RequestRegions(windows=True)``): of the input's datatype
    and shape, but holding none of its bytes (a read-only broadcast zero), so nothing is
    copied in the server. The bytes are ``byte_size`` at ``offset`` of ``region``, which
    the request leases until its response is written."""

    region: SystemRegion
    offset: int
    byte_size: int

    @classmethod
    def over(
        cls, region: SystemRegion, offset: int, byte_size: int, dtype: Any, shape: tuple[int, ...]
    ) -> WindowInput:
        window = stand_in(dtype, shape).view(cls)
        window.region, window.offset, window.byte_size = region, offset, byte_size
        return window


@dataclass(slots=True)
class OutputWindow:
    """Where a requested output goes in a client's system region, for a model whose own
    process may write it there itself (``RequestedOutput.place``): ``written`` says how
    many bytes it wrote, once it did (None: the server writes the output)."""

    region: SystemRegion
    offset: int
    byte_size: int
    written: int | None = None


def stand_in(dtype: Any, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """A read-only array of ``shape`` that holds one zero: a stand-in for bytes elsewhere."""
    return np.broadcast_to(np.zeros((), dtype), shape)
