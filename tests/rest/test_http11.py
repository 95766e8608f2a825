"""The built-in HTTP/1.1 server and the hypercorn adapter, over real sockets: behaviour
both servers must share runs against both (the ``serve`` fixture, ``conftest.py``).
Wire-level strictness that only the built-in server promises, and its HTTP/2 (h2c and
TLS), are in ``test_http11_strict.py``.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trioserve._limits import HttpLimits
from trioserve.rest._asgi import Receive, Scope, Send
from trioserve.rest._http11 import HttpStatistics

from ._raw_http import (
    SERVERS,
    TIMEOUT,
    Client,
    DisconnectWatch,
    Serve,
    echo_app,
    get,
    hello_app,
    read_body,
    small_limits,
    start_response,
)

pytestmark = pytest.mark.usefixtures("close_clients")


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
    watch = DisconnectWatch()
    with trio.fail_after(TIMEOUT):
        client = await Client.connect(await serve(watch.app))
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi")
        await watch.started.wait()
        await client.aclose()
        await watch.disconnected.wait()


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
