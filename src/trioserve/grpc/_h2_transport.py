"""The byte streams an HTTP/2 connection runs over: a plain TCP socket driven directly
(the fast path, as the HTTP/1.1 core does it), or any ``trio.abc.Stream``: TLS through
trio's ``SSLStream``, or an in-memory stream (``trioserve.testing.open_grpc_channel``).

The plain path uses non-blocking stdlib sockets with ``trio.lowlevel.wait_readable`` /
``wait_writable`` rather than ``trio.SocketStream``: a small request costs one ``recv``
and its answer one ``sendmsg``, with no conflict detectors or extra checkpoints.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Protocol

import trio
from trio.lowlevel import notify_closing, wait_readable, wait_writable

from ._h2_frames import Part, trim

RECV_BYTES = 256 * 1024
_IOV_MAX = 512  # parts per sendmsg, well under Linux's 1024


class Transport(Protocol):
    async def recv(self) -> bytes:
        """Some bytes; b"" once the peer closed or the connection failed."""

    async def recv_into(self, view: memoryview) -> int:
        """Like ``recv`` but into ``view``; 0 at the end."""

    def try_send(self, parts: list[Part]) -> int:
        """Send what can go without waiting; the byte count. Raises OSError."""

    async def send_all(self, parts: Sequence[Part]) -> None:
        """Send everything. Raises OSError or trio.BrokenResourceError."""

    async def aclose(self) -> None:
        """Close at once, whatever is unsent (the connection flushed what it could)."""


class SocketTransport:
    __slots__ = ("_full", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._full = False  # the last recv filled its buffer: more is likely waiting

    async def recv(self) -> bytes:
        sock = self.sock
        if not self._full:
            await wait_readable(sock)
        while True:
            try:
                data = sock.recv(RECV_BYTES)
            except BlockingIOError:
                await wait_readable(sock)
                continue
            except OSError:
                return b""
            self._full = len(data) == RECV_BYTES
            return data

    async def recv_into(self, view: memoryview) -> int:
        sock = self.sock
        while True:
            try:
                count = sock.recv_into(view)
            except BlockingIOError:
                await wait_readable(sock)
                continue
            except OSError:
                return 0
            self._full = count == len(view)
            return count

    def try_send(self, parts: list[Part]) -> int:
        try:
            return self.sock.sendmsg(parts if len(parts) <= _IOV_MAX else parts[:_IOV_MAX])
        except BlockingIOError:
            return 0

    async def send_all(self, parts: Sequence[Part]) -> None:
        pending = list(parts)
        while pending:
            await wait_writable(self.sock)
            try:
                sent = self.sock.sendmsg(pending[:_IOV_MAX])
            except BlockingIOError:
                continue
            pending = trim(pending, sent)

    async def aclose(self) -> None:
        notify_closing(self.sock)
        self.sock.close()


class StreamTransport:
    """Any trio stream: every write goes through ``send_all`` (``try_send`` sends
    nothing, since a stream's ``send_all`` is the only way to write)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream

    async def recv(self) -> bytes:
        try:
            return bytes(await self._stream.receive_some(RECV_BYTES))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def recv_into(self, view: memoryview) -> int:
        try:
            data = await self._stream.receive_some(len(view))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return 0
        view[: len(data)] = data
        return len(data)

    def try_send(self, parts: list[Part]) -> int:
        return 0

    async def send_all(self, parts: Sequence[Part]) -> None:
        await self._stream.send_all(b"".join(parts))

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self._stream)
