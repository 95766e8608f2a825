"""One HTTP/1.1 request/response exchange: the ASGI ``receive`` and ``send`` of a request.

The connection (``_http11.py``) parses a head, builds an ``Exchange`` and awaits
``Exchange.run(app)`` in its own task. See ``_http11.py`` for the overall design; this
module holds the per-request half:

* ``receive()`` hands out the body (from the connection's buffer first, then the socket;
  Content-Length or chunked), sends ``100 Continue`` on the first read of a body the
  client is waiting to send, and once the body is complete waits for the client to go
  away (or the response to finish) to return ``http.disconnect``. ``receive_whole()``
  (the ``RECEIVE_WHOLE`` extension) receives a Content-Length body into one buffer of its
  length instead of pieces. A body cut short by the client is answered 400.
* ``send()`` holds the response head back until the first body message so head and body
  go out in one ``send``, adds ``content-length`` when the app sent the body in one
  message, and otherwise frames with chunked encoding (HTTP/1.1) or closes (HTTP/1.0). A
  ``BODY_PARTS`` message, a body as a list of buffers, goes out with them in ``sendmsg``
  calls that continue through the list where the last one stopped.
"""

from __future__ import annotations

import logging
import math
import socket
from typing import Any, Protocol, TypeAlias

import trio
from trio.lowlevel import checkpoint, wait_readable

from .._limits import HttpLimits
from ._asgi import BODY_PARTS, ASGIApp, BodyInto, Message
from ._errors import HttpError
from ._http11_parser import (
    CLOSE,
    STATUS_LINES,
    ChunkedDecoder,
    RequestHead,
    error_response,
    scan_response_headers,
    status_line,
)

logger = logging.getLogger("trioserve.http")

RECV_SIZE = 65536
_BODY_RECV_SIZE = 256 * 1024
_BIG_WRITE = 64 * 1024  # above this, head and body go out with sendmsg instead of a join
_SKIP_BODY_MAX = 64 * 1024  # unread body the server will read and drop to keep a connection
_PIPELINE_CAP = 256 * 1024  # bytes buffered for later requests while the app runs
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_KEEP_ALIVE = b"connection: keep-alive\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

Buffer: TypeAlias = bytes | bytearray | memoryview  # of bytes: a 1-D memoryview of format B

# Response progress.
_NO_RESPONSE, _HEAD_PENDING, _STREAMING, _DONE = range(4)
# Body framing of the response.
_LENGTH, _CHUNKED, _UNTIL_CLOSE, _NO_BODY = range(4)


class _ServerState(Protocol):
    @property
    def date(self) -> bytes: ...

    @property
    def shutting_down(self) -> bool: ...


class Connection(Protocol):
    """What an exchange uses of its connection (``_http11.Connection``): the socket, the
    unparsed input ``buf[pos:]`` that it consumes, and the connection's writes. Declared
    here so that this module needs nothing from ``_http11``, which builds exchanges."""

    buf: bytes
    pos: int
    peer_closed: bool
    torn: bool

    @property
    def sock(self) -> socket.socket: ...

    @property
    def fd(self) -> int: ...

    @property
    def client(self) -> tuple[str, int]: ...

    @property
    def local(self) -> tuple[str, int]: ...

    @property
    def extensions(self) -> dict[str, dict[str, Any]]: ...  # the scope's, per connection

    @property
    def limits(self) -> HttpLimits: ...

    @property
    def server(self) -> _ServerState: ...

    async def recv_body(self, max_bytes: int, deadline: float) -> bytes: ...

    async def recv_whole(
        self, length: int, deadline: float, into: BodyInto | None = None
    ) -> tuple[bytearray | memoryview, int]: ...

    async def write(self, data: bytes) -> bool: ...

    async def write_parts(self, parts: list[Buffer]) -> bool: ...

    async def write_rest(self, parts: list[Buffer], sent: int) -> bool: ...


def _disconnect() -> Message:
    return {"type": "http.disconnect"}


class Exchange:
    """One request/response exchange; the app's ``receive``/``send`` are its methods, so a
    stale reference kept by the app can never touch the next request on the connection."""

    __slots__ = (
        "body_deadline",
        "body_done",
        "body_left",
        "conn",
        "decoder",
        "delivered",
        "dropped",
        "expect_continue",
        "head",
        "keep_alive",
        "out_framing",
        "out_left",
        "plain",
        "response",
        "state",
        "status",
        "waiter",
        "whole",
        "whole_into",
    )

    # Set by http.response.start; read only after it.
    status: int
    plain: bool
    response: tuple[bytes, int, bool, bool]  # see scan_response_headers
    out_framing: int
    out_left: int

    def __init__(self, conn: Connection, head: RequestHead) -> None:
        self.conn = conn
        self.head = head
        self.body_left = length = head[6]
        if head[7]:
            self.decoder: ChunkedDecoder | None = ChunkedDecoder(conn.limits)
            self.body_done = False
        else:
            self.decoder = None
            self.body_done = not length
        self.delivered = False  # the last http.request message went to the app
        self.keep_alive = head[8]
        self.expect_continue = head[9]
        self.state = _NO_RESPONSE
        self.dropped = False  # sends are ignored: client gone or the server answered already
        self.waiter: trio.CancelScope | None = None
        self.body_deadline = math.inf  # set when the body is first waited for
        self.whole = False  # receive a Content-Length body into one buffer (receive_whole)
        self.whole_into: BodyInto | None = None  # that buffer's maker, if not a bytearray

    async def run(self, app: ASGIApp) -> bool:
        """Run the app for this request; True if the connection can carry another one."""
        conn = self.conn
        head = self.head
        scope = {
            "type": "http",
            "asgi": _ASGI.copy(),
            "http_version": head[1],
            "method": head[0],
            "scheme": "http",
            "path": head[2],
            "raw_path": head[3],
            "query_string": head[4],
            "root_path": "",
            "headers": head[5],
            "client": conn.client,
            "server": conn.local,
            "extensions": conn.extensions,
        }
        try:
            await app(scope, self.receive, self.send)
        except Exception:
            logger.exception("ASGI application failed on %s %s", head[0], head[2])
            if self.state != _DONE:
                await self._app_failed()
        else:
            if self.state != _DONE and not (self.dropped or conn.peer_closed):
                logger.error("ASGI application returned without completing its response")
                await self._app_failed()
            # Otherwise the app was told the client left and gave up: nobody to answer,
            # and the connection closes below (a response may be cut short).
        self.state = _DONE
        if self.waiter is not None:
            self.waiter.cancel()
        if not self.keep_alive or self.dropped or conn.peer_closed or conn.torn:
            return False
        if not self.body_done:
            return await self._skip_body()
        return True

    async def _app_failed(self) -> None:
        if self.dropped:
            return
        if self.state < _STREAMING:
            # Nothing written yet, so the client can still get a proper error.
            self.state = _DONE
            connection = self._connection_line(False)
            if not await self.conn.write(error_response(500, "Internal Server Error", connection)):
                self._client_gone()
        else:
            self.keep_alive = False  # response cut short; only closing tells the client

    def _finish(self) -> None:
        self.state = _DONE
        if self.waiter is not None:
            self.waiter.cancel()

    # ------------------------------------------------------------------ receive

    async def receive(self) -> Message:
        if self.dropped:
            return _disconnect()
        if self.body_done:
            if not self.delivered:  # e.g. a GET: one empty message before anything else
                self.delivered = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if self.state == _DONE or self.dropped or self.conn.peer_closed:
                return _disconnect()
            return await self._wait_disconnect()
        if self.expect_continue:
            self.expect_continue = False
            if self.state < _STREAMING and not await self.conn.write(_CONTINUE):
                self._client_gone()
                return _disconnect()
        try:
            body = await self._next_body()
        except HttpError as exc:
            await self._reject_body(exc)
            return _disconnect()
        if self.body_done:
            self.delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.request", "body": body, "more_body": True}

    async def receive_whole(self, into: BodyInto | None = None) -> Message:
        """``receive()``, but a Content-Length body not read yet comes whole, in one
        buffer: ``into``'s, or a ``bytearray`` (``RECEIVE_WHOLE``)."""
        self.whole = True
        self.whole_into = into
        return await self.receive()

    async def _next_body(self) -> bytes | bytearray | memoryview:
        """The next piece of the body.

        HttpError 400 if the client ended its side of the connection before the end of
        the body: it may still read the answer (a half-close), and the app must not take
        a body cut short for the request.
        """
        conn = self.conn
        decoder = self.decoder
        if decoder is None:
            left = self.body_left
            buf = conn.buf
            pos = conn.pos
            avail = len(buf) - pos
            if avail >= left:
                body = buf if pos == 0 and avail == left else buf[pos : pos + left]
                conn.pos = pos + left
                self.body_left = 0
            elif self.whole:
                return await self._read_whole()
            elif avail:
                body = buf[pos:] if pos else buf
                conn.buf = b""
                conn.pos = 0
                self.body_left = left - avail
            else:
                body = await conn.recv_body(min(left, _BODY_RECV_SIZE), self._body_deadline())
                if not body:
                    raise self._cut_short()
                self.body_left = left - len(body)
            if not self.body_left:
                self.body_done = True
            return body
        while True:
            buf = conn.buf
            pos = conn.pos
            if pos < len(buf):
                body, pos = decoder.decode(buf, pos)
                conn.pos = pos
                if decoder.done:
                    self.body_done = True
                    return body
                if body:
                    return body
            data = await conn.recv_body(_BODY_RECV_SIZE, self._body_deadline())
            if not data:
                raise self._cut_short()
            conn.buf = buf[conn.pos :] + data if conn.pos < len(buf) else data
            conn.pos = 0

    async def _read_whole(self) -> bytearray | memoryview:
        """The rest of a Content-Length body in one buffer (``recv_whole``); HttpError 400
        if the client stops before filling it, so nobody reads its unfilled end."""
        into, deadline = self.whole_into, self._body_deadline()
        body, filled = await self.conn.recv_whole(self.body_left, deadline, into)
        self.body_left -= filled
        if self.body_left:
            raise self._cut_short()
        self.body_done = True
        return body

    def _cut_short(self) -> HttpError:
        if self.decoder is not None:
            return HttpError(400, "the client ended the chunked request body before its end")
        return HttpError(
            400,
            f"the client ended the request body after {self.head[6] - self.body_left} of "
            f"its {self.head[6]} bytes",
        )

    def _body_deadline(self) -> float:
        """When the body must be complete: ``body_timeout_s`` after it was first waited for
        (not from the head, so a request answered without its body pays nothing)."""
        if self.body_deadline == math.inf:
            self.body_deadline = trio.current_time() + self.conn.limits.body_timeout_s
        return self.body_deadline

    async def _wait_disconnect(self) -> Message:
        """Block until the client goes away or the response is finished."""
        conn = self.conn
        pipelined = bytearray()  # input for later requests, kept for after this response
        with trio.CancelScope() as scope:
            self.waiter = scope
            try:
                while not (self.state == _DONE or self.dropped or conn.peer_closed):
                    if len(pipelined) > _PIPELINE_CAP:
                        await trio.sleep_forever()  # enough buffered; wait for the response
                    await wait_readable(conn.fd)
                    if self.state == _DONE:
                        break  # the connection task owns the socket again
                    try:
                        data = conn.sock.recv(RECV_SIZE)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        # Could be a half-close from a client still waiting for the answer,
                        # so sends keep going; the app is told and the connection will close.
                        conn.peer_closed = True
                        break
                    pipelined += data
            finally:
                self.waiter = None
                if pipelined:
                    conn.buf = conn.buf[conn.pos :] + pipelined
                    conn.pos = 0
        return _disconnect()

    async def _reject_body(self, exc: HttpError) -> None:
        """A bad or oversized body: answer it ourselves if we still can, then close."""
        self.keep_alive = False
        if self.state < _STREAMING:
            await self.conn.write(error_response(exc.status, exc.message, CLOSE))
        self.dropped = True
        self._finish()

    async def _skip_body(self) -> bool:
        """Read and drop what the app left of the body so the connection can be reused."""
        with trio.move_on_after(self.conn.limits.header_timeout_s):
            try:
                while not self.body_done:
                    await self._next_body()
            except HttpError:
                return False
            return True
        return False

    def _skippable(self) -> bool:
        """Whether an unread body is small enough to drop rather than close over it."""
        if self.decoder is not None:
            return False
        buffered = len(self.conn.buf) - self.conn.pos
        if self.expect_continue:
            # The client waits for 100 Continue that will not come; it may never send.
            return buffered >= self.body_left
        return self.body_left - buffered <= _SKIP_BODY_MAX

    # --------------------------------------------------------------------- send

    async def send(self, message: Message) -> None:
        if self.dropped:
            return
        kind = message["type"]
        if kind == "http.response.body":
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if self.state == _STREAMING:
                await self._send_more(body, more)
            elif self.state != _HEAD_PENDING:
                if self.state == _DONE:
                    raise RuntimeError("http.response.body after the response was complete")
                raise RuntimeError("http.response.body before http.response.start")
            elif more or not self.plain:
                await self._send_first_general(body, more)
            elif len(body) > _BIG_WRITE:
                await self._send_parts([body])
            else:
                # Nearly every response: the whole body in one message. One buffer, one
                # send; kept inline here because it runs once per request.
                block, length, close, has_date = self.response
                if length < 0:
                    extra = b"content-length: %d\r\n" % len(body)
                elif len(body) == length:
                    extra = b""
                else:  # the app's content-length is wrong: the general path reports it
                    await self._send_first_general(body, more)
                    return
                conn = self.conn
                parts = (
                    STATUS_LINES[self.status],
                    block,
                    b"" if has_date else conn.server.date,
                    extra,
                    self._connection_line(close),
                    b"\r\n",
                    body,
                )
                self.state = _DONE
                data = b"".join(parts)
                try:
                    sent = conn.sock.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    sent = -1
                if sent == len(data):
                    ok = True
                elif sent < 0:
                    ok = False
                else:
                    ok = await conn.write_rest([data], sent)
                if not ok:
                    self._client_gone()
                elif self.waiter is not None:
                    self.waiter.cancel()
        elif kind == BODY_PARTS:
            if self.state != _HEAD_PENDING:
                raise RuntimeError(f"{BODY_PARTS} message out of place")
            await self._send_parts(list(message["parts"]))
        elif kind == "http.response.start":
            if self.state != _NO_RESPONSE:
                raise RuntimeError("http.response.start sent twice")
            self.status = status = message["status"]
            self.response = scan_response_headers(message.get("headers", ()))
            # A standard status with a body: what the inline path above can answer.
            self.plain = (
                status in STATUS_LINES
                and status >= 200
                and status != 204
                and status != 304
                and self.head[0] != "HEAD"
            )
            if not self.plain:
                status_line(status)  # validate now so the error lands in the app's call
            self.state = _HEAD_PENDING
        else:
            raise RuntimeError(f"unexpected ASGI message type {kind!r}")

    async def _send_parts(self, parts: list[Buffer]) -> None:
        """A whole body given as buffers, written with the head through ``sendmsg``: no
        buffer joined, nor copied when a send stops part way (``write_rest``)."""
        length = sum(map(len, parts))
        block, declared, close, has_date = self.response
        if not self.plain or declared not in (-1, length):
            # Rare (HEAD, 204, a wrong content-length): the general path, joined.
            await self._send_first_general(b"".join(parts), False)
            return
        head = (
            STATUS_LINES[self.status],
            block,
            b"" if has_date else self.conn.server.date,
            b"content-length: %d\r\n" % length if declared < 0 else b"",
            self._connection_line(close),
            b"\r\n",
        )
        self.state = _DONE
        if not await self.conn.write_parts([b"".join(head), *parts]):
            self._client_gone()
        elif self.waiter is not None:
            self.waiter.cancel()

    def _connection_line(self, close_asked: bool) -> bytes:
        """Settle keep-alive as the head is written; the ``connection`` line saying so."""
        conn = self.conn
        if (
            self.keep_alive
            and not close_asked
            and not conn.server.shutting_down
            and not conn.peer_closed
            and (self.body_done or self._skippable())
        ):
            return _KEEP_ALIVE if self.head[1] == "1.0" else b""
        self.keep_alive = False
        return CLOSE

    async def _send_first_general(self, body: bytes, more: bool) -> None:
        block, length, close, has_date = self.response
        status = self.status
        extra = b""  # framing header line the server adds
        if self.head[0] == "HEAD" or status < 200 or status == 204 or status == 304:
            framing = _NO_BODY
            if length < 0 and self.head[0] == "HEAD" and not more:
                extra = b"content-length: %d\r\n" % len(body)
        elif length >= 0:
            framing = _LENGTH
        elif not more:
            framing = _LENGTH
            length = len(body)
            extra = b"content-length: %d\r\n" % length
        elif self.head[1] == "1.1":
            framing = _CHUNKED
            extra = b"transfer-encoding: chunked\r\n"
        else:
            framing = _UNTIL_CLOSE
            self.keep_alive = False
        self.out_framing = framing
        self.out_left = length
        payload = self._frame(body, more)  # may raise; nothing is written yet, so a 500 can
        head = b"".join(
            (
                status_line(status),
                block,
                b"" if has_date else self.conn.server.date,
                extra,
                self._connection_line(close),
                b"\r\n",
            )
        )
        self.state = _STREAMING
        if len(body) > _BIG_WRITE:
            ok = await self.conn.write_parts([head, *payload])
        else:
            ok = await self.conn.write(b"".join((head, *payload)))
        await self._after_write(ok, more)

    async def _send_more(self, body: bytes, more: bool) -> None:
        payload = self._frame(body, more)
        ok = True
        if len(body) > _BIG_WRITE:
            ok = await self.conn.write_parts(list(payload))
        elif payload:
            ok = await self.conn.write(payload[0] if len(payload) == 1 else b"".join(payload))
        await self._after_write(ok, more)

    def _frame(self, body: bytes, more: bool) -> tuple[bytes, ...]:
        framing = self.out_framing
        if framing == _LENGTH:
            left = self.out_left - len(body)
            if left < 0:
                raise RuntimeError("response body longer than its content-length")
            self.out_left = left
            if not more and left:
                logger.error("response body shorter than its content-length; closing")
                self.keep_alive = False
            return (body,) if body else ()
        if framing == _CHUNKED:
            if body:
                chunk = (b"%x\r\n" % len(body), body, b"\r\n")
                return chunk if more else (*chunk, b"0\r\n\r\n")
            return () if more else (b"0\r\n\r\n",)
        if framing == _UNTIL_CLOSE:
            return (body,) if body else ()
        return ()

    async def _after_write(self, ok: bool, more: bool) -> None:
        if not ok:
            self._client_gone()
        elif not more:
            self._finish()
        else:
            await checkpoint()  # a streaming app that only sends must still yield

    def _client_gone(self) -> None:
        self.dropped = True
        self.keep_alive = False
        self.conn.peer_closed = True
        if self.waiter is not None:
            self.waiter.cancel()
