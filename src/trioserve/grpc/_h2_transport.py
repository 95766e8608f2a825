"""The byte streams an HTTP/2 connection runs over: a plain TCP socket driven directly
(the fast path, as the HTTP/1.1 core does it) or TLS through trio's ``SSLStream``.

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

RECV_BYTES = 256 * 1024
_IOV_MAX = 512  # parts per sendmsg, well under Linux's 1024


class Transport(Protocol):
    async def recv(self) -> bytes:
        """Some bytes; b"" once the peer closed or the connection failed."""

    async def recv_into(self, view: memoryview) -> int:
        """Like ``recv`` but into ``view``; 0 at the end."""

    def try_send(self, parts: list[bytes | memoryview]) -> int:
        """Send what can go without waiting; the byte count. Raises OSError."""

    async def send_all(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send everything. Raises OSError or trio.BrokenResourceError."""

    def close(self) -> None: ...


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

    def try_send(self, parts: list[bytes | memoryview]) -> int:
        try:
            return self.sock.sendmsg(parts if len(parts) <= _IOV_MAX else parts[:_IOV_MAX])
        except BlockingIOError:
            return 0

    async def send_all(self, parts: Sequence[bytes | memoryview]) -> None:
        pending = list(parts)
        while pending:
            await wait_writable(self.sock)
            try:
                sent = self.sock.sendmsg(pending[:_IOV_MAX])
            except BlockingIOError:
                continue
            pending = trim(pending, sent)

    def close(self) -> None:
        notify_closing(self.sock)
        self.sock.close()


class TlsTransport:
    """TLS: every write goes through ``send_all`` (``try_send`` sends nothing)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
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

    def try_send(self, parts: list[bytes | memoryview]) -> int:
        return 0

    async def send_all(self, parts: Sequence[bytes | memoryview]) -> None:
        await self._stream.send_all(b"".join(parts))

    def close(self) -> None:
        self._stream.transport_stream.socket.close()


def trim(parts: list[bytes | memoryview], sent: int) -> list[bytes | memoryview]:
    """What is left of ``parts`` once their first ``sent`` bytes went out."""
    for index, part in enumerate(parts):
        size = len(part)
        if sent < size:
            rest = parts[index:]
            if sent:
                rest[0] = memoryview(part)[sent:]
            return rest
        sent -= size
    return []
