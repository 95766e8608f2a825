"""The built-in HTTP server's connection limit: one connection over it is answered 503
and closed at once, and room made by a closed connection is used again."""

from __future__ import annotations

import trio

import trioserve
from trioserve import HttpLimits, ServerConfig

REQUEST = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n"


async def answer(stream: trio.SocketStream) -> bytes:
    await stream.send_all(REQUEST)
    return bytes(await stream.receive_some(65536))


async def test_a_connection_over_the_limit_is_refused(nursery: trio.Nursery) -> None:
    limits = HttpLimits(max_connections=2)
    config = ServerConfig(http_port=0, grpc_port=None, http_limits=limits)
    server = await nursery.start(trioserve.serve, config)
    port = server.http_port
    with trio.fail_after(20):
        first = await trio.open_tcp_stream("127.0.0.1", port)
        second = await trio.open_tcp_stream("127.0.0.1", port)
        assert (await answer(first)).startswith(b"HTTP/1.1 200")
        assert (await answer(second)).startswith(b"HTTP/1.1 200")
        third = await trio.open_tcp_stream("127.0.0.1", port)
        refused = b""
        while chunk := await third.receive_some(65536):
            refused += chunk  # the answer, then the close
        assert refused.startswith(b"HTTP/1.1 503")
        assert b"too many connections" in refused
        await third.aclose()
        assert _metric(server, "trioserve_http_refused_connections_total") == 1
        await first.aclose()
        while True:  # until the server has seen the first connection go
            again = await trio.open_tcp_stream("127.0.0.1", port)
            try:
                reply = await answer(again)
            except trio.BrokenResourceError:
                reply = b""  # refused and reset before our request was read
            await again.aclose()
            if reply.startswith(b"HTTP/1.1 200"):
                break
            assert reply in (b"",) or reply.startswith(b"HTTP/1.1 503")
        await second.aclose()


def _metric(server: trioserve.Server, name: str) -> float:
    from prometheus_client import generate_latest

    assert server.registry is not None
    for line in generate_latest(server.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")
