"""Our HTTP/2 core on trio streams: accepting connections and serving a method table
(``_call.Method`` by path) on each; ``_serve`` gives it the server's table.

Plain TCP (h2c with prior knowledge, what tritonclient and perf_analyzer speak) by
default; TLS with ALPN ``h2`` when a certificate and key are configured.

Shutdown, once ``shutdown_trigger`` returns: listeners close, every connection sends
GOAWAY with its last stream id (new streams are refused), calls in flight finish, and
each connection closes once it has none; bound the drain by cancelling.
"""

from __future__ import annotations

import logging
import math
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping

import trio

from .._admission import Accepted, Address, Departures
from .._limits import GrpcLimits
from .._sockets import serve_tcp
from . import _h2_frames as h2
from ._call import Method
from ._h2_connection import H2Connection
from ._h2_guard import CoreStatistics, IdleRoster
from ._h2_transport import SocketTransport, StreamTransport, Transport

logger = logging.getLogger("trioserve.grpc")

_TLS_HANDSHAKE_S = 10.0


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    context.set_alpn_protocols(["h2"])
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # RFC 9113 §9.2
    return context


class _CoreServer:
    def __init__(
        self,
        methods: Mapping[str, Method],
        limits: GrpcLimits,
        max_message_bytes: int,
        tls: ssl.SSLContext | None,
        statistics: CoreStatistics,
    ) -> None:
        self.methods = methods
        self.limits = limits
        self.max_message_bytes = max_message_bytes
        self.tls = tls
        self.connections: set[H2Connection] = set()
        self.idle = IdleRoster()
        self.departures = Departures()  # clients that left, torn down a bounded number a turn
        self.open_sockets = 0  # accepted and not yet closed, TLS handshakes included
        # Past this many open sockets, each new one closes the connection idle longest.
        self.crowded = math.ceil(limits.max_connections * limits.idle_close_share)
        self.statistics = statistics
        self.shutting_down = False
        self.opening = h2.opening_frames(limits)

    def accepted(self, connections: trio.Nursery) -> Accepted:
        def start(sock: socket.socket, client: Address, local: Address, received: bytes) -> None:
            if self.open_sockets >= self.limits.max_connections:
                # Closed at once, before any HTTP/2 (as gRPC's own servers refuse past
                # their connection quota): the client's calls fail UNAVAILABLE. No task,
                # no frame, nothing read: a crowd costs an accept and a close each.
                self.statistics.refused_connections += 1
                sock.close()
                return
            if self.open_sockets >= self.crowded:
                self.idle.evict()
            self.open_sockets += 1
            connections.start_soon(self._serve, sock, received)

        return start

    def evicted(self) -> None:
        """A quiet client waiting to start was closed to make room (``_admission``)."""
        self.statistics.idle_evicted += 1

    def greet(self, sock: socket.socket) -> None:
        """The server's opening frames, sent as the socket is accepted, before its
        connection starts (``_admission``): a gRPC client waits for them before it
        sends a call, and the call then tells that this client has something to ask.
        Over the connection limit, the client is refused instead, before any HTTP/2."""
        if self.open_sockets >= self.limits.max_connections:
            self.statistics.refused_connections += 1
            raise ConnectionRefusedError("over the connection limit")  # closed at once
        if sock.send(self.opening) != len(self.opening):  # a fresh socket takes it whole
            raise ConnectionResetError("the client reads nothing")

    def asks(self, received: bytes) -> bool:
        """Whether a greeted client sent more than its preface: a frame other than
        SETTINGS (or its ACK) and WINDOW_UPDATE, such as a call's HEADERS or a PING.
        Not HTTP/2 at all counts too: its connection will answer that."""
        preface = h2.PREFACE
        if not received.startswith(preface):
            return not preface.startswith(received)
        pos = len(preface)
        while pos + h2.FRAME_HEADER_BYTES <= len(received):
            if received[pos + 3] not in (h2.SETTINGS, h2.WINDOW_UPDATE):
                return True
            pos += h2.FRAME_HEADER_BYTES + int.from_bytes(received[pos : pos + 3], "big")
        return False

    async def _serve(self, sock: socket.socket, received: bytes) -> None:
        try:
            await self._serve_socket(sock, received)
        finally:
            self.open_sockets -= 1

    async def _serve_socket(self, sock: socket.socket, received: bytes) -> None:
        transport: Transport
        greeted: bytes | None = None  # not greeted (TLS)
        if self.tls is None:
            greeted = received
            transport = SocketTransport(sock)
        else:
            try:
                transport = await self._handshake(sock)
            except (trio.BrokenResourceError, trio.TooSlowError, OSError) as exc:
                logger.debug("TLS handshake failed: %s", exc)
                sock.close()
                return
        connection = H2Connection(
            transport, self.methods, self.limits, self.max_message_bytes, self.statistics,
            self.idle, self.departures, greeted=greeted,
        )  # fmt: skip
        self.connections.add(connection)
        if self.shutting_down:
            connection.begin_shutdown()
        try:
            await connection.run()
        finally:
            self.connections.discard(connection)

    async def _handshake(self, sock: socket.socket) -> Transport:
        assert self.tls is not None
        stream = trio.SSLStream(
            trio.SocketStream(trio.socket.from_stdlib_socket(sock)), self.tls, server_side=True
        )
        with trio.fail_after(_TLS_HANDSHAKE_S):
            await stream.do_handshake()
        if stream.selected_alpn_protocol() not in (None, "h2"):
            raise trio.BrokenResourceError("the client did not choose h2")
        return StreamTransport(stream)

    async def sweep_idle(self) -> None:
        """Close connections idle for ``idle_timeout_s`` (within a tick): one task for
        all of them, ticking an eighth of the timeout, at most a second."""
        tick = min(1.0, self.limits.idle_timeout_s / 8)
        limit = math.ceil(self.limits.idle_timeout_s / tick)
        while True:
            await trio.sleep(tick)
            for connection in list(self.connections):
                connection.idle_tick(limit)

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        for connection in list(self.connections):
            connection.begin_shutdown()


async def serve_methods(
    methods: Mapping[str, Method],
    host: str,
    port: int,
    limits: GrpcLimits,
    *,
    max_message_bytes: int = 2**31 - 1,
    tls: ssl.SSLContext | None = None,
    statistics: CoreStatistics | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    listeners: list[socket.socket] | None = None,
    task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``methods`` over HTTP/2 on ``host:port`` (or on ``listeners``, bound
    already) until cancelled or shut down.

    Reports the bound ``(host, port)`` pairs once listening (port 0 picks a free one).
    """
    counts = CoreStatistics() if statistics is None else statistics
    server = _CoreServer(methods, limits, max_message_bytes, tls, counts)
    await serve_tcp(
        host, port, server.accepted, server.sweep_idle, server.begin_shutdown,
        greeting=None if tls else server, max_pending=limits.max_connections,
        evicted=server.evicted, shutdown_trigger=shutdown_trigger, listeners=listeners,
        task_status=task_status,
    )  # fmt: skip
