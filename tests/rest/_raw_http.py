"""A raw HTTP/1.1 client, small ASGI apps, and a starter for either HTTP server
(the built-in one or hypercorn), for the tests of both."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, ClassVar

import trio

from trioserve._limits import HttpLimits
from trioserve.rest._asgi import ASGIApp, Receive, Scope, Send
from trioserve.rest._http11 import serve_http11
from trioserve.rest._hypercorn import serve_hypercorn

TIMEOUT = 10

Serve = Callable[..., Awaitable[int]]


class Response:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    """A raw HTTP/1.1 client: sends exactly the bytes a test gives, parses what comes back."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    open_clients: ClassVar[list[Client]] = []  # closed after each test by `close_clients`

    @classmethod
    async def connect(cls, port: int) -> Client:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        cls.open_clients.append(client)
        return client

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _fill(self) -> bool:
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:  # reset by the peer counts as closed
            data = b""
        self.buf += data
        return bool(data)

    async def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not await self._fill():
                raise EOFError(f"closed before {marker!r}; got {self.buf!r}")
        data, _, self.buf = self.buf.partition(marker)
        return data + marker

    async def read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self._fill():
                raise EOFError(f"closed after {len(self.buf)} of {n} bytes")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    async def read_head(self) -> tuple[int, dict[str, str]]:
        head = (await self.read_until(b"\r\n\r\n")).decode("latin-1")
        lines = head.split("\r\n")
        version, status, _ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1"
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return int(status), headers

    async def read_chunk(self) -> bytes:
        size = int((await self.read_until(b"\r\n"))[:-2].split(b";")[0], 16)
        if not size:
            await self.read_until(b"\r\n")  # no trailers from either server
            return b""
        data = await self.read_exactly(size)
        assert await self.read_exactly(2) == b"\r\n"
        return data

    async def read_response(self, *, head_request: bool = False) -> Response:
        status, headers = await self.read_head()
        if head_request or status in (204, 304) or status < 200:
            body = b""
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while chunk := await self.read_chunk():
                parts.append(chunk)
            body = b"".join(parts)
        elif "content-length" in headers:
            body = await self.read_exactly(int(headers["content-length"]))
        else:
            body = await self.read_to_eof()
        return Response(status, headers, body)

    async def read_to_eof(self) -> bytes:
        while await self._fill():
            pass
        data, self.buf = self.buf, b""
        return data

    async def request(self, raw: bytes, *, head_request: bool = False) -> Response:
        await self.send(raw)
        return await self.read_response(head_request=head_request)

    async def aclose(self) -> None:
        await self.stream.aclose()


def get(path: str = "/", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n{extra}\r\n".encode()


async def start_response(send: Send, status: int = 200, headers: Any = ()) -> None:
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})


async def read_body(receive: Receive) -> bytes:
    body: bytes = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise OSError("client went away")
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


async def echo_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with what it saw: scope fields and the body."""
    body = await read_body(receive)
    info = {
        "type": scope["type"],
        "asgi": scope["asgi"],
        "http_version": scope["http_version"],
        "method": scope["method"],
        "scheme": scope["scheme"],
        "path": scope["path"],
        "raw_path": scope["raw_path"].decode("latin-1"),
        "query_string": scope["query_string"].decode("latin-1"),
        "root_path": scope["root_path"],
        "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in scope["headers"]],
        "client": list(scope["client"]),
        "server": list(scope["server"]),
        "body": body.decode("latin-1"),
    }
    await start_response(send, 200, [(b"content-type", b"application/json")])
    await send({"type": "http.response.body", "body": json.dumps(info).encode()})


class DisconnectWatch:
    """An app that reads the body, says so (``started``), then waits for the client to
    go away (``disconnected``): the disconnect contract, on any transport."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.disconnected = trio.Event()

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        self.started.set()
        # The body is complete; this blocks until the client goes away.
        if (await receive())["type"] == "http.disconnect":
            self.disconnected.set()


async def hello_app(scope: Scope, receive: Receive, send: Send) -> None:
    await start_response(send, 200, [(b"content-type", b"text/plain")])
    await send({"type": "http.response.body", "body": b"hello " + scope["path"].encode()})


def small_limits(**changes: Any) -> HttpLimits:
    values: dict[str, Any] = {
        "max_request_line_bytes": 200,
        "max_header_count": 10,
        "max_header_bytes": 1024,
        "max_body_bytes": 100,
    }
    values.update(changes)
    return HttpLimits(**values)


SERVERS = {"http11": serve_http11, "hypercorn": serve_hypercorn}


def starter(kind: str, nursery: trio.Nursery) -> Serve:
    async def start(app: ASGIApp, limits: HttpLimits | None = None, **kwargs: Any) -> int:
        addresses = await nursery.start(
            partial(SERVERS[kind], app, "127.0.0.1", 0, limits or HttpLimits(), **kwargs)
        )
        assert addresses[0][0] == "127.0.0.1"
        return int(addresses[0][1])

    return start
