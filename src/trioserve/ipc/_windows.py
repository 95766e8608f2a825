"""Reading and writing a window of a file another process may shrink at any time,
without faulting.

A page of a mapping that lies past the end of its file faults on access (SIGBUS), and
no check of the size beforehand closes that: the file may shrink between the check and
the access. A read through the file's descriptor cannot fault: at the end of the file
it returns fewer bytes; a write past the end extends the file (so a window found whole
by ``holds`` is written whole, growing the file back to at most the window's end). The
server reads and writes its clients' system shared-memory tensors so, and so does an
instance process the server hands such a region to (the standard library only: the
instance process imports this).
"""

from __future__ import annotations

import os


def read_window(fd: int, position: int, view: memoryview) -> bool:
    """Fill ``view`` (bytes) with the file's bytes from ``position``; False if the file
    ends first (``view`` then holds what was read)."""
    done = 0
    while done < len(view):  # a read may return less than asked, as any read
        count = os.preadv(fd, [view[done:]], position + done)
        if count == 0:  # the end of the file, inside the window
            return False
        done += count
    return True


def holds(fd: int, end: int) -> bool:
    """Whether the file still holds its bytes up to ``end``."""
    return os.fstat(fd).st_size >= end


def write_window(fd: int, position: int, data: memoryview) -> None:
    """Write ``data`` (bytes) at ``position``."""
    while data:  # pwrite may write less than asked, as any write
        written = os.pwrite(fd, data, position)
        data, position = data[written:], position + written


def too_small_message(name: str, byte_size: int, size: int) -> str:
    """How an output larger than the window the request placed it in is refused."""
    return (
        f"shared memory size specified with the request for output '{name}' ({byte_size} "
        f"bytes) should be at least {size} bytes to hold the results"
    )


def shrunk_message(what: str, region: str, key: str, offset: int, byte_size: int) -> str:
    """How a request that met the end of a shrunk object is refused (INVALID_ARG)."""
    return (
        f"{what}: shared memory region '{region}' no longer holds its bytes "
        f"{offset} to {offset + byte_size}: its object '{key}' was shrunk after registration"
    )
