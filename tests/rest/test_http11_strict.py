"""Wire-level strictness that only the built-in HTTP/1.1 server promises (malformed
heads and bodies, limits, timeouts), its sans-IO parser, and HTTP/2 beside it (h2c and
TLS with ALPN), over real sockets.
"""

from __future__ import annotations

import contextlib
import shutil
import ssl
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import httpx
import pytest
import trio
import trio.testing

from trioserve._limits import HttpLimits
from trioserve.rest._asgi import RECEIVE_WHOLE, Receive, Scope, Send
from trioserve.rest._errors import HttpError
from trioserve.rest._http11 import HttpStatistics
from trioserve.rest._http11_parser import ChunkedDecoder, parse_head

from ._raw_http import (
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
    starter,
)

pytestmark = pytest.mark.usefixtures("close_clients")


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
    watch = DisconnectWatch()
    with trio.fail_after(TIMEOUT):
        port = await starter("hypercorn", nursery)(watch.app)
        stream = (await Client.connect(port)).stream  # closed by close_clients on failure
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(
            1,
            [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "t")],
            end_stream=True,
        )
        await stream.send_all(conn.data_to_send())
        await watch.started.wait()
        await stream.aclose()
        await watch.disconnected.wait()


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
