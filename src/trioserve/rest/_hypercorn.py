"""Serve the same ASGI app through hypercorn: HTTP/1.1, HTTP/2 (h2c and TLS/ALPN).

The only module that imports hypercorn. ``HttpLimits`` maps onto hypercorn's ``Config`` where
it has an equivalent:

* ``idle_timeout_s`` -> ``keep_alive_timeout``.
* ``max_request_line_bytes + max_header_bytes`` -> ``h11_max_incomplete_size`` (a larger
  HTTP/1.1 head gets hypercorn's own 431 with an empty body, not our JSON error);
  ``max_header_bytes`` -> ``h2_max_header_list_size``.

What hypercorn has no setting for is enforced by ``_Guard``, a thin ASGI wrapper, with the
same JSON answers as the built-in server: ``max_body_bytes`` (413, up front from
Content-Length, or as a chunked / HTTP/2 body passes it), ``max_header_count`` and
``max_header_bytes`` (431; h11 enforces its size only on heads that arrive in pieces),
``max_request_line_bytes`` for the target (414), and a 500 JSON error when the app fails
before starting its response.

No equivalent at all: ``header_timeout_s`` and ``body_timeout_s``. Hypercorn's ``read_timeout`` applies to every
read for the whole life of a connection, so it would also cut long-lived streaming
responses whose client sends nothing; it stays unset. A slow request head is bounded by
``keep_alive_timeout`` instead, which runs until a complete head has arrived.

Behaviour that differs from the built-in server: ``100 Continue`` is sent by hypercorn as
soon as the head arrives rather than on the app's first ``receive()``; a client that
half-closes its side counts as gone (its response is dropped).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import run as hypercorn_trio_run
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer

from .._limits import HttpLimits
from ._asgi import ASGIApp, Message, Receive, Scope, Send, answer_lifespan
from ._errors import error_body

logger = logging.getLogger("trioserve.http")


async def serve_hypercorn(
    app: ASGIApp,
    host: str,
    port: int,
    limits: HttpLimits,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn on ``host:port`` until cancelled or shut down.

    Same contract as ``serve_http11``; TLS when ``certfile`` and ``keyfile`` are given
    (HTTP/2 negotiated by ALPN), otherwise plain HTTP/1.1 with HTTP/2 by prior knowledge or
    ``Upgrade: h2c``.
    """
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.certfile = certfile
    config.keyfile = keyfile
    config.keep_alive_timeout = limits.idle_timeout_s
    config.h11_max_incomplete_size = limits.max_request_line_bytes + limits.max_header_bytes
    config.h2_max_header_list_size = limits.max_header_bytes
    # The caller bounds the drain with its own timeout and cancels; never give up earlier.
    config.graceful_timeout = math.inf
    # hypercorn closes keep-alive connections after this many requests; the built-in server
    # does not, and a periodic forced reconnect is no limit anyone asked for.
    config.keep_alive_max_requests = 2**62
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = logging.getLogger("trioserve.http.hypercorn")

    trigger = None
    if shutdown_trigger is not None:
        wait_for_shutdown = shutdown_trigger

        async def trigger() -> None:
            await wait_for_shutdown()

    # hypercorn types scopes and messages as TypedDicts, which a Mapping-typed app is not
    # assignable to although it accepts every one of them.
    guard: Any = _Guard(app, limits)
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            partial(serve, guard, config, shutdown_trigger=trigger, mode="asgi")
        )
        task_status.started([_parse_bind(bind) for bind in binds])


class _ClosingTCPServer(TCPServer):
    """hypercorn's connection, closed as soon as its client leaves between requests.

    hypercorn (0.18, trio worker) stops reading at the client's end of stream, but while
    the connection is idle its keep-alive timer task keeps running, and the connection's
    nursery waits for it: the socket stays open (CLOSE_WAIT) with its tasks for the whole
    ``keep_alive_timeout`` after the client left. A client that opens a connection per
    request so pins a descriptor for 75 s per request. The timer only runs while no request
    is in flight, so stopping it once the client's side has ended drops nothing.
    """

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


# hypercorn's trio worker builds each connection from this name of its ``run`` module.
hypercorn_trio_run.TCPServer = _ClosingTCPServer  # type: ignore[attr-defined]


def _parse_bind(bind: str) -> tuple[str, int]:
    """``"http://[::1]:8000"`` -> ``("::1", 8000)``."""
    address = bind.partition("://")[2]
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _Guard:
    """ASGI wrapper: lifespan, the limits hypercorn lacks, and JSON errors as _http11 does."""

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await _Exchange(self.app, self.limits, scope, receive, send).run()
        elif kind == "lifespan":
            await answer_lifespan(receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1003})


class _Exchange:
    """One request through ``_Guard``."""

    def __init__(
        self, app: ASGIApp, limits: HttpLimits, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.app = app
        self.limits = limits
        self.scope = scope
        self._receive = receive
        self._send = send
        self.body_bytes = 0
        self.started = False
        self.gone = False  # client disconnected, or we answered for the app: drop its sends

    async def run(self) -> None:
        scope = self.scope
        limits = self.limits
        headers = scope["headers"]
        if len(headers) > limits.max_header_count:
            await self.error(431, "too many header fields")
            return
        # h11 applies h11_max_incomplete_size only to a head still incomplete in its buffer;
        # one that arrived whole is accepted at any size, so measure it here.
        if sum(len(name) + len(value) + 4 for name, value in headers) > limits.max_header_bytes:
            await self.error(431, "request header section too large")
            return
        if len(scope["raw_path"]) + len(scope["query_string"]) > limits.max_request_line_bytes:
            await self.error(414, "request line too long")
            return
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > limits.max_body_bytes:
                await self.error(413, "request body too large")
                return
        try:
            await self.app(scope, self.receive, self.send)
        except Exception:
            logger.exception("ASGI application failed on %s %s", scope["method"], scope["path"])
            if not self.started and not self.gone:
                await self.error(500, "Internal Server Error")
            return
        if not self.started and not self.gone:
            logger.error("ASGI application returned without completing its response")
            await self.error(500, "Internal Server Error")

    async def receive(self) -> Message:
        if self.gone:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.request":
            self.body_bytes += len(message.get("body", b""))
            if self.body_bytes > self.limits.max_body_bytes:
                if not self.started:
                    await self.error(413, "request body too large")
                self.gone = True
                return {"type": "http.disconnect"}
        elif message["type"] == "http.disconnect":
            self.gone = True
        return message

    async def send(self, message: Message) -> None:
        if self.gone:
            return  # same as _http11: sends after a disconnect are dropped
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def error(self, status: int, message: str) -> None:
        """Answer in the app's place with ``{"error": message}``."""
        body = error_body(message)
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ]
        if status != 500 and self.scope.get("http_version", "1.1") in ("1.0", "1.1"):
            # The request was not (fully) read: the connection cannot carry another one.
            headers.append((b"connection", b"close"))
        self.started = True
        self.gone = True
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})
