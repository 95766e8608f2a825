"""Client system shared-memory inputs in an instance process: the descriptors of the
client regions the server handed over, and the inputs of a batch read from them.

The server sends a region's descriptor once per process (a ``windows`` frame, as arena
segments are announced) and each input that lies in it as (serial, position, size); it
tells the process to close the descriptor once the region is released (``unwindow``).
An input is read with ``preadv`` into a block of the process's own arena (memory used
before, so the copy costs no page faults; the block is freed when the model's last array
of it goes) before the model runs: the client may shrink its object at any time, and a
mapped page past the end of the file would kill the process (SIGBUS) under the model's
feet, while a read just comes back short, which refuses that request alone (INVALID_ARG
naming the region) and leaves the rest of the batch to run. The batch's inputs are read
by the thread that read its frame, before any later frame (an ``unwindow``) is read. An
output the request placed in a client's region is written there with ``pwrite``
(``write_outputs``), which cannot fault either, once every such output of the response
was checked to fit its window and the object to still hold it (else the response is that
INVALID_ARG, and nothing is written); it writes through a duplicate of the descriptor,
taken under a lock: the batch runs on another thread than the one that reads frames, and
the request may have been withdrawn and its region let go of meanwhile. Standard library
and numpy only.
"""

from __future__ import annotations

import os
import threading
from typing import Any, NamedTuple

import numpy as np

from .._errors import InferenceServerError, InvalidArgumentError, UnavailableError
from .._tensor import array_to_raw, datatype
from ..ipc._arena import Arena
from ..ipc._windows import holds, read_window, shrunk_message, too_small_message, write_window
from ._pb_wire import leased

WINDOW = "window"  # the mark of a tensor that lies in a client region, in an exec frame


class _Handed(NamedTuple):
    fd: int
    name: str  # the region's, as the client registered it
    key: str  # its object's
    offset: int  # where the region's window starts in the object


class ClientWindows:
    """The client regions this process holds a descriptor of, by serial."""

    def __init__(self) -> None:
        self._regions: dict[int, _Handed] = {}
        self._lock = threading.Lock()  # the reading thread changes it, batches write

    def add(self, regions: list[tuple[int, str, str, int]], fds: list[int]) -> None:
        with self._lock:
            for (serial, name, key, offset), fd in zip(regions, fds, strict=True):
                self._regions[serial] = _Handed(fd, name, key, offset)

    def forget(self, serials: list[int]) -> None:
        with self._lock:
            for serial in serials:
                handed = self._regions.pop(serial, None)
                if handed is not None:
                    os.close(handed.fd)

    def read_batch(
        self, requests: list[tuple[Any, ...]], arena: Arena
    ) -> tuple[list[tuple[Any, ...]], dict[int, tuple[int, InferenceServerError]]]:
        """The batch's requests with their window inputs read (as inline tensors), and
        the refused ones by their place in the batch: their key, and why."""
        if not self._regions:  # none handed over, so no input lies in one
            return requests, {}
        read: list[tuple[Any, ...]] = []
        refused: dict[int, tuple[int, InferenceServerError]] = {}
        for place, request in enumerate(requests):
            try:
                read.append(self._read_request(request, arena))
            except InferenceServerError as exc:
                refused[place] = (request[0], exc)
        return read, refused

    def _read_request(self, request: tuple[Any, ...], arena: Arena) -> tuple[Any, ...]:
        tensors = request[3]
        if all(len(t) != 7 for t in tensors):  # the usual request: nothing to read
            return request
        return (*request[:3], [self._read(t, arena) if len(t) == 7 else t for t in tensors],
                *request[4:])  # fmt: skip

    def _read(self, tensor: tuple[Any, ...], arena: Arena) -> tuple[Any, ...]:
        """The tensor inline, its bytes in a block of ``arena``."""
        name, datatype_name, shape, _mark, serial, offset, byte_size = tensor
        handed = self._regions[serial]
        block = arena.allocate(byte_size)
        view = arena.view(block)
        if not read_window(handed.fd, handed.offset + offset, view):
            arena.free(block)
            raise InvalidArgumentError(
                shrunk_message(f"input '{name}'", handed.name, handed.key, offset, byte_size)
            )
        return (
            name,
            datatype_name,
            shape,
            leased(np.frombuffer(view, np.uint8), arena.free, block),
        )

    def write_outputs(
        self, outputs: list[Any], placed: dict[str, tuple[int, int, int, str]]
    ) -> dict[str, tuple[Any, ...]]:
        """Write the ``pb_utils.Tensor`` outputs that ``placed`` names into their windows,
        those of their declared datatype (the server converts and writes any other);
        each as the ``done`` frame names it (by window), by name."""
        writes: list[tuple[int, int, memoryview]] = []  # a duplicate descriptor, where, what
        written = {}
        try:
            for tensor in outputs:
                name = tensor.name()
                place = placed.get(name)
                if place is None or place[3] != tensor.datatype_name():
                    continue
                serial, offset, byte_size, datatype_name = place
                array = tensor.as_numpy()
                raw = memoryview(array_to_raw(array, datatype(datatype_name))).cast("B")
                if raw.nbytes > byte_size:
                    raise InvalidArgumentError(too_small_message(name, byte_size, raw.nbytes))
                with self._lock:
                    handed = self._regions.get(serial)
                    if handed is None:  # a withdrawn request's region, let go of
                        raise UnavailableError(f"output '{name}': its region was unregistered")
                    fd = os.dup(handed.fd)
                writes.append((fd, handed.offset + offset, raw))
                if not holds(fd, handed.offset + offset + raw.nbytes):
                    what = f"output '{name}'"
                    raise InvalidArgumentError(
                        shrunk_message(what, handed.name, handed.key, offset, raw.nbytes)
                    )
                written[name] = (name, datatype_name, array.shape, WINDOW, serial, offset,
                                 raw.nbytes)  # fmt: skip
            for fd, position, raw in writes:  # every one checked before any is written
                write_window(fd, position, raw)
        finally:
            for fd, _position, _raw in writes:
                os.close(fd)
        return written
