"""The built-in HTTP/1.1 server and the hypercorn adapter, over real sockets.

Behaviour both servers must share runs against both (the ``serve`` fixture); wire-level
strictness that only the built-in server promises runs against it alone.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import trio
import trio.testing

from trioserve._limits import HttpLimits
from trioserve.rest._asgi import RECEIVE_WHOLE, ASGIApp, Receive, Scope, Send
from trioserve.rest._errors import HttpError
from trioserve.rest._http11 import HttpStatistics, serve_http11
from trioserve.rest._http11_parser import ChunkedDecoder, parse_head
from trioserve.rest._hypercorn import serve_hypercorn

TIMEOUT = 10

Serve = Callable[..., Awaitable[int]]


# ------------------------------------------------------------------------------- helpers


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


@pytest.fixture(autouse=True)
async def close_clients() -> AsyncIterator[None]:
    yield
    while Client.open_clients:
        await Client.open_clients.pop().aclose()


def starter(kind: str, nursery: trio.Nursery) -> Serve:
    async def start(app: ASGIApp, limits: HttpLimits | None = None, **kwargs: Any) -> int:
        addresses = await nursery.start(
            partial(SERVERS[kind], app, "127.0.0.1", 0, limits or HttpLimits(), **kwargs)
        )
        assert addresses[0][0] == "127.0.0.1"
        return int(addresses[0][1])

    return start


@pytest.fixture(params=sorted(SERVERS))
def serve(request: pytest.FixtureRequest, nursery: trio.Nursery) -> Serve:
    """Starts an app on one of the two servers, on 127.0.0.1 and a free port."""
    return starter(request.param, nursery)


@pytest.fixture
def serve11(nursery: trio.Nursery) -> Serve:
    """Starts an app on the built-in HTTP/1.1 server only."""
    return starter("http11", nursery)


# ------------------------------------------------------------- behaviour of both servers


async def test_scope(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        port = await serve(echo_app)
        client = await Client.connect(port)
        response = await client.request(
            b"POST /a%20b/c?x=1&y=%20 HTTP/1.1\r\nHost: test\r\nX-Mixed-Case: Value\r\n"
            b"Content-Length: 5\r\n\r\nhello"
        )
        assert response.status == 200
        assert response.headers["content-type"] == "application/json"
        info = response.json()
        assert info["type"] == "http"
        assert info["asgi"]["version"] == "3.0"
        assert info["http_version"] == "1.1"
        assert info["method"] == "POST"
        assert info["scheme"] == "http"
        assert info["path"] == "/a b/c"
        assert info["raw_path"] == "/a%20b/c"
        assert info["query_string"] == "x=1&y=%20"
        assert info["root_path"] == ""
        assert ["x-mixed-case", "Value"] in info["headers"]
        assert ["content-length", "5"] in info["headers"]
        assert info["client"][0] == "127.0.0.1"
        assert info["server"] == ["127.0.0.1", port]
        assert info["body"] == "hello"


async def test_builtin_asgi_spec_version(serve11: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(echo_app))
        response = await client.request(get())
        assert response.json()["asgi"] == {"version": "3.0", "spec_version": "2.3"}


async def test_keep_alive_reuses_the_connection(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(hello_app))
        for path in ("/one", "/two", "/three"):
            response = await client.request(get(path))
            assert response.status == 200
            assert response.body == b"hello " + path.encode()
            assert response.headers.get("connection") != "close"


async def test_connection_close_is_honoured(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(hello_app))
        response = await client.request(get("/x", "Connection: close\r\n"))
        assert response.status == 200
        assert response.headers["connection"] == "close"
        assert await client.read_to_eof() == b""


async def test_http10_closes_by_default(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(hello_app))
        response = await client.request(b"GET /old HTTP/1.0\r\n\r\n")
        assert response.body == b"hello /old"
        assert await client.read_to_eof() == b""


async def test_pipelined_requests_are_answered_in_order(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app))
        await client.send(
            b"POST /1 HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
            + get("/2")
            + b"POST /3 HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nxy\r\n0\r\n\r\n"
        )
        seen = [
            (r.json()["path"], r.json()["body"])
            for r in [await client.read_response() for _ in range(3)]
        ]
        assert seen == [("/1", "abc"), ("/2", ""), ("/3", "xy")]


async def test_head_trickled_byte_by_byte(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app))
        for byte in b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nok":
            await client.send(bytes([byte]))
            await trio.testing.wait_all_tasks_blocked()
        response = await client.read_response()
        assert (response.json()["path"], response.json()["body"]) == ("/slow", "ok")


async def test_next_request_arriving_while_app_waits_for_disconnect(serve: Serve) -> None:
    waiting = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        if scope["path"] == "/first":

            async def watch() -> None:
                waiting.set()
                assert (await receive())["type"] == "http.disconnect"

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await trio.testing.wait_all_tasks_blocked()
                # The test pipelines the next request now; it must not count as a
                # disconnect, and must be served after this response.
                await second_sent.wait()
                await hello_app(scope, receive, send)
        else:
            await hello_app(scope, receive, send)

    second_sent = trio.Event()
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        await client.send(get("/first"))
        await waiting.wait()
        await client.send(get("/second"))
        await trio.testing.wait_all_tasks_blocked()
        second_sent.set()
        assert (await client.read_response()).body == b"hello /first"
        assert (await client.read_response()).body == b"hello /second"


async def test_chunked_request_body_with_extensions_and_trailers(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app))
        response = await client.request(
            b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;name=value\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: yes\r\n\r\n"
        )
        assert response.status == 200
        assert response.json()["body"] == "hello world"


async def test_large_body_arrives_in_full(serve: Serve) -> None:
    size = 3 * 1024 * 1024

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        await start_response(send)
        await send({"type": "http.response.body", "body": b"%d %d" % (len(body), body.count(b"x"))})

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                client.send,
                b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size,
            )
            response = await client.read_response()
        assert response.body == b"%d %d" % (size, size)


async def test_large_response_body(serve: Serve) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB, more than one socket buffer

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await start_response(send)
        await send({"type": "http.response.body", "body": body})

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        response = await client.request(get())
        assert response.body == body


async def test_head_request_has_no_body(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(hello_app))
        response = await client.request(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n", head_request=True)
        assert response.status == 200
        # The connection is still in sync: the next response starts right away.
        assert (await client.request(get("/y"))).body == b"hello /y"


async def test_head_request_gets_the_length_of_the_get_body(serve11: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(hello_app))
        response = await client.request(b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n", head_request=True)
        assert response.headers["content-length"] == str(len(b"hello /x"))
        assert (await client.request(get("/y"))).body == b"hello /y"


async def test_one_message_body_gets_content_length(serve11: Serve) -> None:
    body = b"x" * 200_000  # also past the size where head and body go out with sendmsg

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await start_response(send, 200)
        await send({"type": "http.response.body", "body": body})

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(app))
        response = await client.request(get())
        assert response.headers["content-length"] == str(len(body))
        assert "transfer-encoding" not in response.headers
        assert response.body == body


async def test_empty_body_gets_content_length_zero(serve11: Serve) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await start_response(send, 200)
        await send({"type": "http.response.body"})

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(app))
        response = await client.request(get())
        assert response.headers["content-length"] == "0"
        assert response.body == b""


async def test_streaming_response_is_chunked_and_flushed(serve: Serve) -> None:
    first_seen = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await start_response(send, 200, [(b"content-type", b"text/event-stream")])
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await first_seen.wait()  # only reachable if the first event was already delivered
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        await client.send(get("/events"))
        status, headers = await client.read_head()
        assert status == 200
        assert headers["transfer-encoding"] == "chunked"
        assert "content-length" not in headers
        assert await client.read_chunk() == b"data: 1\n\n"
        first_seen.set()
        assert await client.read_chunk() == b"data: 2\n\n"
        assert await client.read_chunk() == b""
        assert (await client.request(get("/after"))).status == 200  # still usable


async def test_app_content_length_is_used_for_streamed_body(serve: Serve) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await start_response(send, 200, [(b"content-length", b"6")])
        await send({"type": "http.response.body", "body": b"abc", "more_body": True})
        await send({"type": "http.response.body", "body": b"def"})

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        response = await client.request(get())
        assert "transfer-encoding" not in response.headers
        assert response.body == b"abcdef"


async def test_app_exception_before_response_is_a_json_500(serve: Serve) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/fail":
            raise ValueError("boom")
        await hello_app(scope, receive, send)

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        response = await client.request(get("/fail"))
        assert response.status == 500
        assert response.headers["content-type"] == "application/json"
        assert "error" in response.json()
        # Neither the connection nor the server is harmed.
        other = await Client.connect(client.stream.socket.getpeername()[1])
        assert (await other.request(get("/fine"))).body == b"hello /fine"


async def test_app_exception_after_response_started_closes(serve: Serve) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await start_response(send, 200)
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        raise ValueError("boom")

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        await client.send(get())
        status, headers = await client.read_head()
        assert status == 200
        assert headers["transfer-encoding"] == "chunked"
        assert await client.read_chunk() == b"partial"
        assert b"0\r\n\r\n" not in await client.read_to_eof()  # cut, not completed


async def test_app_returning_without_response_is_a_500(serve: Serve) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        return

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        response = await client.request(get())
        assert response.status == 500
        assert response.headers["content-type"] == "application/json"


async def test_client_disconnect_mid_request_reaches_receive(serve: Serve) -> None:
    started = trio.Event()
    disconnected = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        started.set()
        # The body is complete; this blocks until the client goes away.
        if (await receive())["type"] == "http.disconnect":
            disconnected.set()

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
        await started.wait()
        await client.aclose()
        await disconnected.wait()


async def test_client_disconnect_while_body_is_read(serve: Serve) -> None:
    disconnected = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
                return

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\npart")
        await client.aclose()
        await disconnected.wait()


async def test_finished_response_releases_pending_receive(serve: Serve) -> None:
    released = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)

        async def watch() -> None:
            if (await receive())["type"] == "http.disconnect":
                released.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await trio.testing.wait_all_tasks_blocked()
            await start_response(send)
            await send({"type": "http.response.body", "body": b"done"})

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        assert (await client.request(get())).body == b"done"
        await released.wait()
        assert (await client.request(get())).body == b"done"  # connection still usable


async def test_sends_after_disconnect_are_dropped_silently(serve: Serve) -> None:
    outcome: list[str] = []
    gone = trio.Event()
    app_done = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            await receive()  # the (empty) body
            if (await receive())["type"] == "http.disconnect":
                gone.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await start_response(send)
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
                await gone.wait()
                for _ in range(20):
                    await send(
                        {"type": "http.response.body", "body": b"y" * 1000, "more_body": True}
                    )
                await send({"type": "http.response.body", "body": b""})
            outcome.append("returned")
        except BaseException as exc:
            outcome.append(repr(exc))
            raise
        finally:
            app_done.set()

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(app))
        await client.send(get())
        await client.read_head()
        await client.aclose()
        await app_done.wait()
        assert outcome == ["returned"]


async def test_413_for_large_content_length(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app, small_limits()))
        response = await client.request(
            b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 101\r\n\r\n"
        )
        assert response.status == 413
        assert response.headers["content-type"] == "application/json"
        assert "error" in response.json()


async def test_413_when_chunked_body_passes_the_limit(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app, small_limits()))
        chunk = b"3c\r\n" + b"z" * 60 + b"\r\n"
        response = await client.request(
            b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk + chunk
        )
        assert response.status == 413
        assert "error" in response.json()


async def test_414_for_long_request_target(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app, small_limits()))
        response = await client.request(get("/" + "a" * 300))
        assert response.status == 414
        assert "error" in response.json()


async def test_431_for_too_many_headers(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app, small_limits()))
        extra = "".join(f"X-H{i}: v\r\n" for i in range(11))
        response = await client.request(get("/", extra))
        assert response.status == 431


async def test_431_for_oversized_header_section(serve: Serve) -> None:
    limits = small_limits(max_header_count=100)
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app, limits))
        response = await client.request(get("/", "X-Big: " + "b" * 2000 + "\r\n"))
        assert response.status == 431


async def test_100_continue_then_body(serve: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(echo_app))
        await client.send(
            b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        assert (await client.read_response()).status == 100
        await client.send(b"body")
        assert (await client.read_response()).json()["body"] == "body"


async def test_idle_keep_alive_connection_is_closed(
    serve: Serve, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(1000):
        client = await Client.connect(await serve(hello_app, HttpLimits(idle_timeout_s=30)))
        assert (await client.request(get())).status == 200
        before = trio.current_time()
        assert await client.read_to_eof() == b""
        assert 30 <= trio.current_time() - before <= 35


async def test_idle_closes_are_counted(
    serve11: Serve, autojump_clock: trio.testing.MockClock
) -> None:
    statistics = HttpStatistics()
    with trio.fail_after(1000):
        port = await serve11(hello_app, HttpLimits(idle_timeout_s=30), statistics=statistics)
        client = await Client.connect(port)
        assert (await client.request(get())).status == 200
        assert await client.read_to_eof() == b""
    assert statistics == HttpStatistics(idle_closed=1)


async def test_connection_closed_at_once_when_its_idle_client_leaves(
    serve: Serve, autojump_clock: trio.testing.MockClock
) -> None:
    """A client that ends its side between requests is gone: the server closes its side
    then, not when the idle timeout would have closed the connection anyway."""
    with trio.fail_after(1000):
        client = await Client.connect(await serve(hello_app, HttpLimits(idle_timeout_s=30)))
        assert (await client.request(get())).status == 200
        before = trio.current_time()
        await client.stream.send_eof()
        assert await client.read_to_eof() == b""
        assert trio.current_time() - before < 1


async def test_graceful_shutdown(serve: Serve) -> None:
    shutdown = trio.Event()
    in_app = trio.Event()
    release = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/slow":
            in_app.set()
            await release.wait()
        await hello_app(scope, receive, send)

    with trio.fail_after(TIMEOUT):
        port = await serve(app, shutdown_trigger=shutdown.wait)
        idle = await Client.connect(port)
        assert (await idle.request(get("/warm"))).status == 200
        busy = await Client.connect(port)
        await busy.send(get("/slow"))
        await in_app.wait()

        shutdown.set()
        assert await idle.read_to_eof() == b""  # idle keep-alive connection closed at once
        with pytest.raises(OSError, match="all attempts to connect"):  # listener closed first
            await trio.open_tcp_stream("127.0.0.1", port)
        release.set()
        response = await busy.read_response()  # the request in progress still completes
        assert response.body == b"hello /slow"
        assert await busy.read_to_eof() == b""


@pytest.mark.parametrize("kind", sorted(SERVERS))
async def test_shutdown_returns_once_requests_finish(nursery: trio.Nursery, kind: str) -> None:
    shutdown = trio.Event()
    release = trio.Event()
    in_app = trio.Event()
    returned = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        in_app.set()
        await release.wait()
        await hello_app(scope, receive, send)

    async def run(task_status: trio.TaskStatus[list[tuple[str, int]]]) -> None:
        await SERVERS[kind](
            app,
            "127.0.0.1",
            0,
            HttpLimits(),
            shutdown_trigger=shutdown.wait,
            task_status=task_status,
        )
        returned.set()

    with trio.fail_after(TIMEOUT):
        addresses = await nursery.start(run)
        client = await Client.connect(addresses[0][1])
        await client.send(get())
        await in_app.wait()
        shutdown.set()
        await trio.testing.wait_all_tasks_blocked()
        assert not returned.is_set()  # still draining
        release.set()
        assert (await client.read_response()).status == 200
        await returned.wait()


# --------------------------------------------------------- built-in server strictness


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /\r\nHost: t\r\n\r\n", 400),
        (b"GET  / HTTP/1.1\r\nHost: t\r\n\r\n", 400),
        (b"GET / HTTP/1.1 \r\nHost: t\r\n\r\n", 400),
        (b"GET / http/1.1\r\nHost: t\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\nHost: t\r\n\r\n", 505),
        (b"G(T / HTTP/1.1\r\nHost: t\r\n\r\n", 400),
        (b"GET /\x7f HTTP/1.1\r\nHost: t\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nX-Folded: a\r\n  b\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost : t\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHo[st: t\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nNo-Colon\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n: empty-name\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\nX: y\r\n\r\n", 400),
        (b"GET / HTTP/1.1\nHost: t\n\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 3, 4\r\n\r\nabcd", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: -3\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 0x3\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: +3\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: identity\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET nowhere HTTP/1.1\r\n\r\n", 400),
    ],
)
async def test_malformed_requests(serve11: Serve, raw: bytes, status: int) -> None:
    with trio.fail_after(TIMEOUT):
        port = await serve11(echo_app)
        client = await Client.connect(port)
        response = await client.request(raw)
        assert response.status == status
        assert response.headers["content-type"] == "application/json"
        assert isinstance(response.json()["error"], str)
        assert response.headers["connection"] == "close"
        assert await client.read_to_eof() == b""
        fresh = await Client.connect(port)
        assert (await fresh.request(get())).status == 200


@pytest.mark.parametrize(
    "chunks",
    [
        b"5\r\nhelloXX0\r\n\r\n",  # no CRLF after data
        b"0x5\r\nhello\r\n0\r\n\r\n",  # prefixed size
        b"-5\r\nhello\r\n0\r\n\r\n",
        b" 5\r\nhello\r\n0\r\n\r\n",
        b"5\nhello\r\n0\r\n\r\n",  # bare LF
        b"zz\r\n",
    ],
)
async def test_malformed_chunked_body(serve11: Serve, chunks: bytes) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(echo_app))
        response = await client.request(
            b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks
        )
        assert response.status == 400
        assert "error" in response.json()


async def test_leading_empty_line_split_across_reads(serve11: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(hello_app))
        for piece in (b"\r", b"\n\r", b"\nGET /x HTTP/1.1\r", b"\n\r\n"):
            await client.send(piece)
            await trio.testing.wait_all_tasks_blocked()
        assert (await client.read_response()).body == b"hello /x"


async def test_bare_lf_in_partial_head_is_refused_at_once(serve11: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(echo_app))
        response = await client.request(b"GET / HTTP/1.1\nHost: t")  # head not even complete
        assert response.status == 400


async def test_identical_duplicate_content_length_is_accepted(serve11: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(echo_app))
        response = await client.request(
            b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok"
        )
        assert response.json()["body"] == "ok"


async def test_leading_empty_lines_and_absolute_form(serve11: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(echo_app))
        response = await client.request(b"\r\nGET http://example.com/p%2Fq?z=1 HTTP/1.1\r\n\r\n")
        info = response.json()
        assert (info["path"], info["raw_path"], info["query_string"]) == ("/p/q", "/p%2Fq", "z=1")


async def test_413_error_is_readable_when_client_keeps_sending(serve11: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(echo_app, small_limits()))
        async with trio.open_nursery() as nursery:

            async def push() -> None:
                with contextlib.suppress(trio.BrokenResourceError):
                    await client.send(
                        b"POST / HTTP/1.1\r\nContent-Length: 100000\r\n\r\n" + b"q" * 100000
                    )

            nursery.start_soon(push)
            response = await client.read_response()
        assert response.status == 413


async def test_header_timeout_answers_408(
    serve11: Serve, autojump_clock: trio.testing.MockClock
) -> None:
    limits = HttpLimits(header_timeout_s=5, idle_timeout_s=100)
    statistics = HttpStatistics()
    with trio.fail_after(1000):
        client = await Client.connect(await serve11(hello_app, limits, statistics=statistics))
        await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n")  # and never the blank line
        before = trio.current_time()
        response = await client.read_response()
        assert response.status == 408
        assert "error" in response.json()
        assert 5 <= trio.current_time() - before <= 6
        assert await client.read_to_eof() == b""
    assert statistics == HttpStatistics(header_timeouts=1)


@pytest.mark.parametrize("whole", [False, True])
async def test_body_timeout_answers_408_to_a_trickling_body(
    serve11: Serve, autojump_clock: trio.testing.MockClock, whole: bool
) -> None:
    """One byte every 2 s never stalls for the idle timeout: only the body timeout, which
    bounds the whole body, ends it (read in pieces, or whole into one buffer)."""
    told: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if whole:
            receive = scope["extensions"][RECEIVE_WHOLE]["receive"]
        while (message := await receive())["type"] == "http.request":
            if not message["more_body"]:
                await hello_app(scope, receive, send)
                return
        told.append(message["type"])  # the server answered for us: just leave

    async def trickle(client: Client) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while True:
                await trio.sleep(2)
                await client.send(b"x")

    limits = HttpLimits(body_timeout_s=10, idle_timeout_s=5)
    statistics = HttpStatistics()
    with trio.fail_after(1000):
        port = await serve11(app, limits, statistics=statistics)
        client = await Client.connect(port)
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n")
        before = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle, client)
            response = await client.read_response()
            assert response.status == 408
            assert response.json() == {"error": "timed out reading the request body"}
            assert response.headers["connection"] == "close"
            assert trio.current_time() - before == pytest.approx(10)
            assert await client.read_to_eof() == b""
            nursery.cancel_scope.cancel()
        assert told == ["http.disconnect"]
        assert statistics.body_timeouts == 1
        # A body that arrives in time is served, however slowly it came.
        client = await Client.connect(port)
        await client.send(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\n")
        for byte in b"body":
            await trio.sleep(2)
            await client.send(bytes([byte]))
        assert (await client.read_response()).body == b"hello /slow"


async def test_body_timeout_flag() -> None:
    from trioserve._cli import _parser, config_from_args

    args = _parser().parse_args(["run", "--http-body-timeout-secs", "7.5"])
    assert config_from_args(args).http_limits.body_timeout_s == 7.5
    assert config_from_args(_parser().parse_args(["run"])).http_limits.body_timeout_s == 60


@pytest.mark.parametrize(
    ("flag", "field", "text", "value"),
    [
        ("--http-max-request-line-bytes", "max_request_line_bytes", "1024", 1024),
        ("--http-header-timeout-secs", "header_timeout_s", "2.5", 2.5),
    ],
)
async def test_head_limits_have_flags(flag: str, field: str, text: str, value: float) -> None:
    from trioserve._cli import _parser, config_from_args

    default = config_from_args(_parser().parse_args(["run"])).http_limits
    assert getattr(default, field) == getattr(HttpLimits(), field)
    limits = config_from_args(_parser().parse_args(["run", flag, text])).http_limits
    assert getattr(limits, field) == value


async def test_100_continue_sent_only_when_body_is_read(serve11: Serve) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/read":
            await read_body(receive)
        await hello_app(scope, receive, send)

    head = b"POST %s HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(app))
        await client.send(head % b"/read")
        assert await client.read_until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        await client.send(b"body")
        assert (await client.read_response()).body == b"hello /read"

        # Answered without reading: no 100, and the connection closes (the body never came).
        await client.send(head % b"/ignore")
        response = await client.read_response()
        assert response.status == 200
        assert response.headers["connection"] == "close"
        assert await client.read_to_eof() == b""


async def test_unread_small_body_is_skipped_to_keep_the_connection(serve11: Serve) -> None:
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(hello_app))
        response = await client.request(b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
        assert response.headers.get("connection") != "close"
        assert (await client.request(get("/b"))).body == b"hello /b"


async def test_http10_keep_alive_and_streaming(serve11: Serve) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await start_response(send)
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})

    with trio.fail_after(TIMEOUT):
        port = await serve11(hello_app)
        client = await Client.connect(port)
        response = await client.request(b"GET /k HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert response.headers["connection"] == "keep-alive"
        assert (await client.request(b"GET /k2 HTTP/1.0\r\n\r\n")).body == b"hello /k2"

        client = await Client.connect(await serve11(app))
        response = await client.request(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert "transfer-encoding" not in response.headers  # 1.0: delimited by closing
        assert response.body == b"ab"


async def test_response_header_injection_is_refused(serve11: Serve) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await start_response(send, 200, [(b"x-evil", b"a\r\nset-cookie: b")])
        await send({"type": "http.response.body", "body": b""})

    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve11(app))
        response = await client.request(get())
        assert response.status == 500
        assert "set-cookie" not in response.headers


# ------------------------------------------------------------------ sans-IO parser units


async def test_chunked_decoder_at_every_split_point() -> None:
    wire = b"4;ext=1\r\nwiki\r\n6\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\nT: v\r\n\r\nNEXT"
    for split in range(len(wire) + 1):
        decoder = ChunkedDecoder(HttpLimits())
        body, pos = decoder.decode(wire[:split], 0)
        rest = wire[pos:]  # the connection keeps what was not consumed
        more, end = decoder.decode(rest, 0)
        assert decoder.done, split
        assert body + more == b"wikipedia in \r\n\r\nchunks.", split
        assert rest[end:] == b"NEXT", split


async def test_cached_request_line_still_obeys_smaller_limits() -> None:
    raw = b"GET /" + b"a" * 100 + b" HTTP/1.1\r\nHost: t\r\n\r\n"
    end = raw.index(b"\r\n\r\n")
    assert parse_head(raw, 0, end, HttpLimits())[2] == "/" + "a" * 100  # now cached
    with pytest.raises(HttpError) as error:
        parse_head(raw, 0, end, HttpLimits(max_request_line_bytes=50))
    assert error.value.status == 414


# ------------------------------------------------------------------------ HTTP/2 (h2c)


async def test_h2c_prior_knowledge_with_httpx(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await starter("hypercorn", nursery)(echo_app)
        async with httpx.AsyncClient(http1=False, http2=True) as client:
            response = await client.post(f"http://127.0.0.1:{port}/h2?q=1", content=b"two")
        assert response.http_version == "HTTP/2"
        info = response.json()
        assert (info["http_version"], info["path"], info["body"]) == ("2", "/h2", "two")


async def test_h2c_disconnect_reaches_app(nursery: trio.Nursery) -> None:
    """The same disconnect contract over HTTP/2, driven with the h2 library directly."""
    started = trio.Event()
    disconnected = trio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        started.set()
        if (await receive())["type"] == "http.disconnect":
            disconnected.set()

    with trio.fail_after(TIMEOUT):
        port = await starter("hypercorn", nursery)(app)
        stream = (await Client.connect(port)).stream  # closed by close_clients on failure
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(
            1,
            [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "t")],
            end_stream=True,
        )
        await stream.send_all(conn.data_to_send())
        await started.wait()
        await stream.aclose()
        await disconnected.wait()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_with_alpn_h2(nursery: trio.Nursery, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    with trio.fail_after(TIMEOUT):
        await trio.run_process(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
            capture_stdout=True, capture_stderr=True,
        )  # fmt: skip
        port = await starter("hypercorn", nursery)(echo_app, certfile=str(cert), keyfile=str(key))
        context = ssl.create_default_context(cafile=str(cert))
        async with httpx.AsyncClient(http2=True, verify=context) as client:
            response = await client.get(f"https://127.0.0.1:{port}/secure")
        assert response.http_version == "HTTP/2"
        assert response.json()["scheme"] == "https"
