"""The built-in gRPC server's connection limit: a connection over it is closed as soon as
it is accepted (before any HTTP/2), counted, and a slot that a closed connection frees is
used again. Real gRPC clients see UNAVAILABLE."""

from __future__ import annotations

import grpc
import pytest
import trio

import trioserve
from trioserve import GrpcLimits, Server, ServerConfig
from trioserve.grpc._generated import grpc_service_pb2 as pb

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
SETTINGS = 4
REFUSED = "trioserve_grpc_refused_connections_total"


async def start(nursery: trio.Nursery, limit: int) -> Server:
    config = ServerConfig(
        http_port=None, grpc_port=0, grpc_limits=GrpcLimits(max_connections=limit)
    )
    server: Server = await nursery.start(trioserve.serve, config)
    return server


async def first_frame_type(stream: trio.SocketStream) -> int | None:
    """The type of the first frame the server sends after our preface; None if it
    closes the connection instead."""
    try:
        await stream.send_all(PREFACE)
        received = b""
        while len(received) < 9:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return None
            received += chunk
    except trio.BrokenResourceError:  # reset: closed with our preface unread
        return None
    return received[3]


async def test_a_connection_over_the_limit_is_closed_and_counted(nursery: trio.Nursery) -> None:
    server = await start(nursery, limit=2)
    assert server.registry is not None
    port = server.grpc_port
    assert port is not None
    with trio.fail_after(20):
        first = await trio.open_tcp_stream("127.0.0.1", port)
        second = await trio.open_tcp_stream("127.0.0.1", port)
        assert await first_frame_type(first) == SETTINGS
        assert await first_frame_type(second) == SETTINGS
        assert server.registry.get_sample_value(REFUSED) == 0
        third = await trio.open_tcp_stream("127.0.0.1", port)
        assert await first_frame_type(third) is None
        await third.aclose()
        assert server.registry.get_sample_value(REFUSED) == 1
        await first.aclose()
        while True:  # until the server has seen the first connection go
            again = await trio.open_tcp_stream("127.0.0.1", port)
            answer = await first_frame_type(again)
            if answer is not None:
                break
            await again.aclose()
        assert answer == SETTINGS
        refused = server.registry.get_sample_value(REFUSED)
        assert refused is not None and refused >= 1
        # Two connections again (second and again): a real client over the limit.
        answer_text = await trio.to_thread.run_sync(server_live, port)
        assert answer_text.startswith("UNAVAILABLE")
        await again.aclose()
        await second.aclose()
        while (answer_text := await trio.to_thread.run_sync(server_live, port)) != "OK":
            assert answer_text.startswith("UNAVAILABLE")


def server_live(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.unary_unary(
            "/inference.GRPCInferenceService/ServerLive",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=pb.ServerLiveResponse.FromString,
        )
        try:
            method(pb.ServerLiveRequest(), timeout=5)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
        return "OK"


@pytest.mark.parametrize("flags", [[], ["--grpc-max-connections", "7"]])
def test_the_flag_sets_the_limit(flags: list[str]) -> None:
    from trioserve._cli import _parser, config_from_args

    config = config_from_args(_parser().parse_args(["run", *flags]))
    assert config.grpc_limits.max_connections == (int(flags[1]) if flags else 4096)
    assert config.http_limits.max_connections == 4096
