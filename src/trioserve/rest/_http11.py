"""The built-in HTTP/1.1 server: hosts an ASGI 3 app on trio, tuned for the fast path.

Design (why it is shaped like this):

* One task per connection, and the app is awaited in that task: no task spawn, channel or
  event per request. The connection drives non-blocking stdlib sockets directly through
  ``trio.lowlevel.wait_readable``/``wait_writable`` rather than ``trio.SocketStream``,
  which would add a checkpoint and conflict detectors to every call; a keep-alive request
  costs one ``recv``, one ``send`` and one trio checkpoint (the wait for the next request).
* Timeouts cost nothing per request: instead of a cancel scope per wait, one sweeper task
  per server counts how long each connection has been idle or reading a head and cancels
  the connection's scope when it is over (see ``_Server.sweep_timeouts``).
* Disconnect detection is lazy: nobody reads the socket while the app runs unless the app
  asks, by awaiting ``receive()`` or by registering what to give up if the client hangs
  up (the ``trioserve.cancel_with`` scope extension: ``_http11_hangups.py``, polled from
  one task per server, no task or system call per request). Once the request body is complete, ``receive()`` waits for the socket to become
  readable; bytes that arrive are kept for the next (pipelined) request, EOF means the
  client went away and ``receive()`` returns ``http.disconnect``. Finishing the response
  ends that wait too (also ``http.disconnect``). Apps that never call ``receive()`` after
  the body pay nothing. Only one task at a time may await ``receive()``.
* Pipelined requests are answered in order for free: they stay in the connection's buffer
  and are parsed once the current response is complete.
* The response head is held back until the first body message, so head and body go out in
  one ``send``, with ``content-length`` filled in when the app sent the body in one message
  (see ``_http11_exchange.py``; request parsing is in ``_http11_parser.py``).

Send after disconnect: once the server knows the client is gone (a write failed, or
stalled for ``idle_timeout_s``), or after the server answered the request itself (e.g. 413
for a chunked body that grew too large), ``send()`` silently drops messages; it never
raises into the app for that. Apps learn of the disconnect from ``receive()``. A client
that only half-closes still gets its response, but ``receive()`` reports the disconnect.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import trio
from trio.lowlevel import checkpoint, notify_closing, wait_readable, wait_writable

from .._admission import Accepted, Address, Departures
from .._limits import HttpLimits
from .._sockets import serve_tcp
from ._asgi import BODY_PARTS, CANCEL_WITH, RECEIVE_WHOLE, ASGIApp, BodyInto, Message
from ._errors import HttpError
from ._http11_exchange import RECV_SIZE, Buffer, Exchange
from ._http11_hangups import Hangups
from ._http11_parser import (
    CLOSE,
    RequestHead,
    check_partial_head,
    date_line,
    error_response,
    parse_head,
)

logger = logging.getLogger("trioserve.http")

_LINGER_S = 1.0
_LINGER_BYTES = 1024 * 1024

# sendmsg's limit on buffers per call is IOV_MAX (1024 on Linux); a response of more
# parts is written in turns of this many.
_MAX_PARTS = 512

_Read = TypeVar("_Read", bytes, int)

# A bytearray of a given length whose bytes are left unset (the C API's constructor given
# no source), for a body received into it at once. ``bytearray(n)`` would zero it first:
# a pass over memory about to be overwritten, which also commits every page of a length
# that a client may only have announced.
_unset_bytearray = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t)(
    ("PyByteArray_FromStringAndSize", ctypes.pythonapi)
)

# Where a connection is, for the timeout sweeper: waiting for a request, reading a head, or
# anything else (the app runs, a body is read, a response is written).
_IDLE, _HEAD, _BUSY = range(3)


@dataclass
class HttpStatistics:
    """What the server's limits turned away (exported by ``HTTP_COUNTERS``)."""

    refused_connections: int = 0  # answered 503 on accept, over the connection limit
    header_timeouts: int = 0  # answered 408: a request head took too long
    body_timeouts: int = 0  # answered 408: a request body took too long
    idle_closed: int = 0  # closed for being idle: keep-alive, or waiting to start in a crowd


HTTP_COUNTERS = {
    "refused_connections": "HTTP connections answered 503 for being over the connection limit",
    "header_timeouts": "HTTP requests answered 408 for a request head that took too long",
    "body_timeouts": "HTTP requests answered 408 for a request body that took too long",
    "idle_closed": "HTTP connections closed for being idle (kept alive, or silent while "
    "a crowd arrived)",
}


class _Server:
    __slots__ = (
        "app", "connections", "date", "departures", "hangups", "limits", "shutting_down",
        "statistics",
    )  # fmt: skip

    def __init__(self, app: ASGIApp, limits: HttpLimits, statistics: HttpStatistics) -> None:
        self.app = app
        self.limits = limits
        self.statistics = statistics
        self.hangups = Hangups()  # the clients that leave while their request waits
        self.connections: set[Connection] = set()
        self.departures = Departures()  # clients that left, torn down a bounded number a turn
        self.shutting_down = False
        # The ``date`` line, refreshed by the sweeper (at least once a second) rather than
        # formatted per response.
        self.date = date_line()

    def begin_shutdown(self) -> None:
        self.shutting_down = True
        for conn in list(self.connections):
            if conn.phase == _IDLE:
                conn.expire()

    async def sweep(self) -> None:
        """The server's background: the timeouts' sweeper and the hangup watch."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.hangups.run)
            await self.sweep_timeouts()

    async def sweep_timeouts(self) -> None:
        """Enforce idle and header timeouts for all connections from one task.

        A cancel scope per wait would cost more than the rest of a small request's
        handling, so connections only count phase changes (``epoch``) and this sweep counts
        how many ticks each has spent in its current phase. A timeout therefore fires
        between its value and one tick later; the tick is an eighth of the shorter timeout,
        at most a second.
        """
        limits = self.limits
        tick = min(1.0, limits.idle_timeout_s / 8, limits.header_timeout_s / 8)
        idle_ticks = math.ceil(limits.idle_timeout_s / tick)
        head_ticks = math.ceil(limits.header_timeout_s / tick)
        while True:
            await trio.sleep(tick)
            self.date = date_line()
            for conn in list(self.connections):
                phase = conn.phase
                if phase == _BUSY:
                    continue
                if conn.seen_epoch != conn.epoch:
                    conn.seen_epoch = conn.epoch
                    conn.ticks = 0
                else:
                    conn.ticks += 1
                    if phase == _IDLE and conn.ticks >= idle_ticks:
                        self.statistics.idle_closed += 1
                        conn.expire()
                    elif phase == _HEAD and conn.ticks >= head_ticks:
                        self.statistics.header_timeouts += 1
                        conn.expire()

    def evicted(self) -> None:
        """A silent client waiting to start was closed to make room (``_admission``)."""
        self.statistics.idle_closed += 1

    def accepted(self, nursery: trio.Nursery) -> Accepted:
        def start(sock: socket.socket, client: Address, local: Address, received: bytes) -> None:
            if len(self.connections) >= self.limits.max_connections:
                self.statistics.refused_connections += 1
                _refuse(sock)
                return
            conn = Connection(self, sock, client, local)
            conn.buf = received  # (empty: HTTP/1.1 has no greeting)
            self.connections.add(conn)
            nursery.start_soon(conn.run)

        return start


def _refuse(sock: socket.socket) -> None:
    """Answer a connection over the limit without spending a task on it: the answer
    fits the socket's buffer, so one non-blocking send delivers it (or nothing does)."""
    with contextlib.suppress(OSError):
        sock.send(error_response(503, "too many connections: try again later", CLOSE))
    sock.close()


class Connection:
    __slots__ = (
        "buf",
        "client",
        "epoch",
        "exchange",
        "expired",
        "extensions",
        "fd",
        "hangup",
        "limits",
        "local",
        "peer_closed",
        "phase",
        "pos",
        "scope",
        "seen_epoch",
        "server",
        "sock",
        "ticks",
        "torn",
    )

    def __init__(
        self,
        server: _Server,
        sock: socket.socket,
        client: tuple[str, int],
        local: tuple[str, int],
    ) -> None:
        self.server = server
        self.limits = server.limits
        self.sock = sock
        self.fd = sock.fileno()
        self.hangup = server.hangups.hook(self)
        # The ASGI scope's extensions, the same for each request on this connection.
        self.extensions: dict[str, dict[str, Any]] = {
            CANCEL_WITH: {"cancel_with": self.hangup.cancel_with},
            RECEIVE_WHOLE: {"receive": self.receive_whole},
            BODY_PARTS: {},
        }
        self.exchange: Exchange | None = None  # the request being served
        self.client = client
        self.local = local
        # Unparsed input is buf[pos:]; bytes + offset so a whole request parses without copies.
        self.buf = b""
        self.pos = 0
        self.peer_closed = False  # EOF or error seen on the read side
        self.torn = False  # a write was interrupted part way: the byte stream is unusable
        # Timeout bookkeeping (see _Server.sweep_timeouts).
        self.phase = _IDLE
        self.epoch = 0
        self.seen_epoch = -1
        self.ticks = 0
        self.expired = -1  # the phase in which a timeout or shutdown ended the connection
        self.scope = trio.CancelScope()

    def expire(self) -> None:
        self.expired = self.phase
        self.scope.cancel()

    async def run(self) -> None:
        try:
            with self.scope:
                await self._serve()
            if self.expired == _HEAD:
                # Outside the cancelled scope, so the answer can still be written.
                await self.write(error_response(408, "timed out reading the request head", CLOSE))
                await self._linger_close()
        except Exception:
            logger.exception("HTTP connection from %s:%d failed", *self.client)
        finally:
            self.server.connections.discard(self)
            self.server.hangups.closed(self.hangup)
            notify_closing(self.sock)
            self.sock.close()

    async def _serve(self) -> None:
        while True:
            try:
                head = await self._next_head()
            except HttpError as exc:
                self.phase = _BUSY  # answered: the sweeper must not add a 408 to this
                await self.write(error_response(exc.status, exc.message, CLOSE))
                await self._linger_close()
                return
            if head is None:
                return
            self.exchange = request = Exchange(self, head)
            carries_on = await request.run(self.server.app)
            self.exchange = None
            if self.hangup.withdraw is not None:  # the response is over: nothing waits
                self.hangup.cancel_with(None)
            if not carries_on:
                if not self.peer_closed:
                    await self._linger_close()
                return

    async def _next_head(self) -> RequestHead | None:
        """The next request head, or None when the connection should just close."""
        buf = self.buf
        pos = self.pos
        waited = False
        while True:
            while buf.startswith(b"\r\n", pos):  # RFC 9112 2.2: ignore blank lines first
                pos += 2
            if pos < len(buf):
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    return await self._slow_head(buf[pos:])
                if end + 4 == len(buf):
                    self.buf = b""
                    self.pos = 0
                else:
                    self.buf = buf
                    self.pos = end + 4
                self.phase = _BUSY
                self.epoch += 1
                if not waited:
                    # Pipelined input: yield once per request so one connection's backlog
                    # cannot starve the others.
                    await checkpoint()
                return parse_head(buf, pos, end, self.limits)
            if self.server.shutting_down or self.peer_closed:
                return None
            self.phase = _IDLE
            self.epoch += 1
            # _wait_input() inlined: one frame less to suspend and resume per request.
            await wait_readable(self.fd)
            if self.expired >= 0:
                return None  # idle timeout, or shutdown closing idle connections
            try:
                buf = self.sock.recv(RECV_SIZE)
            except BlockingIOError:
                continue
            except OSError:
                buf = b""
            if not buf:
                self.peer_closed = True
                await self.server.departures.leave_in_turn()  # not a whole crowd at once
                return None
            pos = 0
            waited = True

    async def _slow_head(self, partial: bytes) -> RequestHead | None:
        """Collect a head that arrives in pieces, under the header timeout.

        A bytearray and searches that resume where the last one stopped keep a head
        trickled in byte by byte linear in its size, not quadratic.
        """
        limits = self.limits
        head = bytearray(partial)
        self.phase = _HEAD  # the header timeout runs from the first byte
        self.epoch += 1
        checked = 0
        while True:
            check_partial_head(head, checked, limits)
            data = await self._wait_input()
            if not data:  # None: header timeout, answered 408 by run(); b"": client closed
                self.peer_closed = data is not None
                return None
            checked = len(head)
            head += data
            while head.startswith(b"\r\n"):
                del head[:2]
                checked = 0
            end = head.find(b"\r\n\r\n", max(checked - 3, 0))
            if end >= 0:
                buf = bytes(head)
                self.buf = buf
                self.pos = end + 4
                self.phase = _BUSY
                self.epoch += 1
                return parse_head(buf, 0, end, limits)

    async def _wait_input(self) -> bytes | None:
        """Wait for request-head input: the bytes, ``b""`` at EOF, None once expired.

        Waits first: after a response the next request is rarely there yet, and a recv
        that fails with EAGAIN would be a wasted system call. No deadline here: the
        sweeper cancels ``self.scope``; ``expired`` covers a wakeup that raced with it.
        """
        while True:
            await wait_readable(self.fd)
            if self.expired >= 0:
                return None
            data = self._recv_ready()
            if data is not None:
                return data

    def _recv_ready(self) -> bytes | None:
        """One recv after readiness: the bytes, ``b""`` at EOF or error, None if spurious."""
        try:
            return self.sock.recv(RECV_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def receive_whole(self, into: BodyInto | None = None) -> Awaitable[Message]:
        """The ``RECEIVE_WHOLE`` extension's ``receive``: the current request's."""
        if self.exchange is None:
            raise RuntimeError("receive_whole() outside a request")
        return self.exchange.receive_whole(into)

    async def recv_body(self, max_bytes: int, deadline: float) -> bytes:
        """Body bytes (at most ``max_bytes``); ``b""`` at EOF, error or a stalled upload.

        HttpError 408 past ``deadline``: a body that trickles in keeps making progress, so
        only a bound on the whole body frees the connection from it.
        """
        return await self._body_read(partial(self.sock.recv, max_bytes), deadline) or b""

    async def recv_whole(
        self, length: int, deadline: float, into: BodyInto | None = None
    ) -> tuple[bytearray | memoryview, int]:
        """The next ``length`` body bytes in one buffer: ``into(length)``'s if it gives
        one, else a bytearray allocated at that length; the buffered ones copied in, the
        socket's received into it in place, no pieces to join. A new buffer each time,
        as the app's views of one (input tensors) may outlive the request. With how many
        arrived: all unless the client closed, failed or stalled first (the rest was
        never written: it must not be read). HttpError 408 past ``deadline``."""
        given = None if into is None else into(length)
        body: bytearray | memoryview = _unset_bytearray(None, length) if given is None else given
        with memoryview(body) as view:  # released: the app may resize its bytearray
            filled = len(self.buf) - self.pos
            view[:filled] = memoryview(self.buf)[self.pos :]
            self.buf = b""
            self.pos = 0
            recv_into = self.sock.recv_into
            while filled < length:
                count = await self._body_read(partial(recv_into, view[filled:]), deadline)
                if count is None:
                    break
                filled += count
        return body, filled

    async def _body_read(self, read: Callable[[], _Read], deadline: float) -> _Read | None:
        """One ``read`` of body input (``recv`` or ``recv_into``): what it returned, None
        at EOF, error or a stalled upload (no progress for ``idle_timeout_s`` counts as
        the client having gone). HttpError 408 past ``deadline``."""
        try:
            data: _Read | None = read()  # a body is usually already in flight: try first
        except BlockingIOError:
            data = None
        except OSError:
            self.peer_closed = True
            return None
        if data is not None:
            await checkpoint()  # got data without waiting: still be a checkpoint
        else:
            stalled = trio.current_time() + self.limits.idle_timeout_s
            while data is None:
                with trio.move_on_at(min(stalled, deadline)) as scope:
                    await wait_readable(self.fd)
                if scope.cancelled_caught:
                    if deadline < stalled:
                        self.server.statistics.body_timeouts += 1
                        raise HttpError(408, "timed out reading the request body")
                    break
                try:
                    data = read()
                except BlockingIOError:
                    continue
                except OSError:
                    break
        if not data:
            self.peer_closed = True
            return None
        return data

    async def write(self, data: bytes) -> bool:
        """Send all of ``data``; False if the client is gone."""
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            return False
        if sent == len(data):
            return True
        return await self.write_rest([data], sent)

    async def write_parts(self, parts: list[Buffer]) -> bool:
        """Like ``write(b"".join(parts))`` without copying: one ``sendmsg`` of the parts
        (byte buffers) as they are."""
        try:
            sent = self.sock.sendmsg(parts[:_MAX_PARTS])
        except BlockingIOError:
            sent = 0
        except OSError:
            return False
        if len(parts) <= _MAX_PARTS and sent == sum(map(len, parts)):
            return True
        return await self.write_rest(parts, sent)

    async def write_rest(self, parts: list[Buffer], sent: int) -> bool:
        """Send what is left of ``parts`` (byte buffers, changed in place) after the
        first ``sent`` bytes, as the client takes it: the list is advanced past what each
        ``sendmsg`` took, never joined."""
        # If this is cancelled part way, the response on the wire is cut; `torn` makes sure
        # the connection is not reused for another request afterwards.
        self.torn = True
        first = 0  # parts[first:] is still to go, less `sent` bytes of parts[first]
        while True:
            while first < len(parts) and sent >= len(parts[first]):
                sent -= len(parts[first])
                first += 1
            if first == len(parts):
                break
            if sent:
                parts[first] = memoryview(parts[first])[sent:]
                sent = 0
            with trio.move_on_after(self.limits.idle_timeout_s) as scope:
                await wait_writable(self.fd)
            if scope.cancelled_caught:
                return False  # a reader that takes nothing for that long has gone
            try:
                sent = self.sock.sendmsg(parts[first : first + _MAX_PARTS])
            except BlockingIOError:
                continue
            except OSError:
                return False
        self.torn = False
        return True

    async def _linger_close(self) -> None:
        """Half-close and drain input briefly, so unread request bytes do not make the kernel
        answer with a RST that could destroy the response before the client reads it."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        budget = _LINGER_BYTES
        with trio.move_on_after(_LINGER_S):
            while budget > 0:
                await wait_readable(self.fd)
                try:
                    data = self.sock.recv(RECV_SIZE)
                except BlockingIOError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                budget -= len(data)


async def serve_http11(
    app: ASGIApp,
    host: str,
    port: int,
    limits: HttpLimits,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    statistics: HttpStatistics | None = None,
    listeners: list[socket.socket] | None = None,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` over HTTP/1.1 on ``host:port`` (or on ``listeners``, bound already)
    until cancelled or shut down, counting what the limits turn away in ``statistics``.

    ``task_status.started`` gets the bound ``(host, port)`` pairs (port 0 picks one). When
    ``shutdown_trigger`` returns, new connections are refused, idle keep-alive connections
    are closed, requests in progress finish (their connection closes afterwards), and then
    this returns; bound the drain by cancelling.
    """
    server = _Server(app, limits, HttpStatistics() if statistics is None else statistics)
    await serve_tcp(
        host, port, server.accepted, server.sweep, server.begin_shutdown,
        max_pending=limits.max_connections, evicted=server.evicted,
        shutdown_trigger=shutdown_trigger, listeners=listeners, task_status=task_status,
    )  # fmt: skip
