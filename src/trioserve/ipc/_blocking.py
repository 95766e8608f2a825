"""A child process's end of a link, for its threads: ``BlockingChannel``. No trio here,
so that a child running model code (perhaps under another environment's interpreter)
imports only the standard library and ``_frames``.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

from ._frames import (
    ANCILLARY_BYTES,
    READ_BYTES,
    FrameReader,
    Outgoing,
    ancillary,
    encode_frames,
    received_fds,
)


class LinkClosed(EOFError):
    """The peer closed its end (or died)."""


class BlockingChannel:
    """A child process's end, for threads. ``send`` is safe from any thread: a thread
    that finds another writing leaves its frame for it and returns."""

    def __init__(self, sock: socket.socket) -> None:
        self._socket = sock
        self._reader = FrameReader()
        self._ready: list[tuple[Any, list[int]]] = []
        self._pending: list[Outgoing] = []
        self._lock = threading.Lock()
        self._writing = False

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        with self._lock:
            self._pending.append((message, fds))
            if self._writing:
                return
            self._writing = True
        try:
            while True:
                with self._lock:
                    batch, self._pending = self._pending, []
                    if not batch:
                        self._writing = False
                        return
                data, all_fds = encode_frames(batch)
                view = memoryview(data)
                sent = self._socket.sendmsg([view], ancillary(all_fds))
                if sent < len(view):
                    self._socket.sendall(view[sent:])
        except OSError as exc:
            with self._lock:
                self._writing = False
            raise LinkClosed(f"the peer is gone: {exc}") from None

    def receive(self) -> tuple[Any, list[int]]:
        """The next frame; one reading thread at a time."""
        while not self._ready:
            try:
                data, ancdata, _flags, _address = self._socket.recvmsg(READ_BYTES, ANCILLARY_BYTES)
            except ConnectionResetError as exc:  # it died with frames of ours unread
                raise LinkClosed(f"the peer is gone: {exc}") from None
            fds = received_fds(ancdata)
            if not data:
                for fd in fds:
                    os.close(fd)
                raise LinkClosed("the peer closed the link")
            self._ready.extend(self._reader.feed(data, fds))
        return self._ready.pop(0)

    def close(self) -> None:
        self._reader.close()
        self._socket.close()


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected stream sockets: the parent's and the child's (inheritable)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child.set_inheritable(True)
    return parent, child
