"""The method table both gRPC front ends serve, and how failures become statuses."""

from __future__ import annotations

import logging
import os
import resource
import socket
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import pytest
import trio
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

import trioserve
from trioserve import (
    ErrorKind,
    InvalidArgumentError,
    NotFoundError,
    Server,
    ServerConfig,
    UnsupportedError,
)
from trioserve._context import server_context
from trioserve._served import ModelRepository
from trioserve.grpc._errors import GRPC_STATUS, GrpcError, GrpcStatus, status_of
from trioserve.grpc._generated import grpc_service_pb2, health_pb2
from trioserve.grpc._methods import StreamMethod, UnaryMethod, grpc_methods
from trioserve.models import reference_zoo

TIMEOUT = 20  # seconds; generous for a loaded machine, still fails a hung test


def test_the_table_covers_the_service() -> None:
    """Every RPC of the proto, with the request type it declares; streaming where it does."""
    methods = grpc_methods(server_context(ServerConfig(), ModelRepository([])))
    service = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    expected = {f"/{service.full_name}/{m.name}": m for m in service.methods}
    assert set(methods) == {*expected, "/grpc.health.v1.Health/Check"}
    for path, rpc in expected.items():
        method = methods[path]
        assert method.request_type.DESCRIPTOR is rpc.input_type, path
        streaming = rpc.client_streaming or rpc.server_streaming
        assert isinstance(method, StreamMethod if streaming else UnaryMethod), path
    health = methods["/grpc.health.v1.Health/Check"]
    assert health.request_type is health_pb2.HealthCheckRequest


def test_every_status_code() -> None:
    assert [(s.name, int(s)) for s in GrpcStatus][:3] == [
        ("OK", 0), ("CANCELLED", 1), ("UNKNOWN", 2),
    ]  # fmt: skip
    assert len(GrpcStatus) == 17 and GrpcStatus.UNAUTHENTICATED == 16
    assert set(GRPC_STATUS) == set(ErrorKind)
    assert getattr(grpc.StatusCode, GrpcStatus(12).name).value[0] == 12  # grpcio agrees


def test_status_of_client_mistakes_logs_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="trioserve.grpc")
    assert status_of(NotFoundError("no such model")) == (GrpcStatus.NOT_FOUND, "no such model")
    assert status_of(UnsupportedError("later")) == (GrpcStatus.UNIMPLEMENTED, "later")
    too_big = GrpcError(GrpcStatus.RESOURCE_EXHAUSTED, "larger than max")
    assert status_of(too_big) == (GrpcStatus.RESOURCE_EXHAUSTED, "larger than max")
    assert [(r.levelno, r.exc_info) for r in caplog.records] == [(logging.DEBUG, None)] * 3


def test_status_of_our_bug_is_internal_with_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    try:
        raise KeyError("oops")
    except KeyError as exc:
        bug = exc
    with caplog.at_level(logging.DEBUG, logger="trioserve.grpc"):
        assert status_of(bug) == (GrpcStatus.INTERNAL, "the call failed unexpectedly")
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert record.exc_info[1] is bug


# --- on the wire, each front end -------------------------------------------------------


@pytest.fixture
async def server(nursery: trio.Nursery, grpc_server: str) -> Server:
    config = ServerConfig(
        models=reference_zoo(), http_port=None, grpc_port=0, grpc_server=grpc_server
    )
    started: Server = await nursery.start(trioserve.serve, config)
    return started


@pytest.fixture
def channel(server: Server) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as opened:
        yield opened


async def call(fn: Any, *args: Any) -> Any:
    return await trio.to_thread.run_sync(partial(fn, *args), abandon_on_cancel=True)


def raw_bytes_rpc(channel: grpc.Channel, kind: str, rpc: str) -> Any:
    """A method of the service that sends the bytes it is given as its request message."""
    reply = service_pb2.ModelStreamInferResponse if kind == "stream_stream" else None
    return getattr(channel, kind)(
        f"/inference.GRPCInferenceService/{rpc}",
        request_serializer=lambda body: body,
        response_deserializer=(reply or getattr(service_pb2, f"{rpc}Response")).FromString,
    )


def no_warnings(caplog: pytest.LogCaptureFixture) -> bool:
    """Nothing above DEBUG logged, and no traceback."""
    return not [r for r in caplog.records if r.levelno > logging.DEBUG or r.exc_info]


async def test_malformed_message_is_invalid_argument_and_no_error_logged(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    raw = raw_bytes_rpc(channel, "unary_unary", "ModelInfer")
    with pytest.raises(DecodeError):
        service_pb2.ModelInferRequest.FromString(b"\xff\xff")  # what the client sends
    with trio.fail_after(TIMEOUT), caplog.at_level(logging.DEBUG, logger="trioserve"):
        with pytest.raises(grpc.RpcError) as caught:
            await call(raw, b"\xff\xff")
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request message" in str(caught.value.details())
        with pytest.raises(grpc.RpcError) as refused:  # a client mistake of the core's
            await call(raw, service_pb2.ModelInferRequest(model_name="nope").SerializeToString())
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert no_warnings(caplog)
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 2


async def test_malformed_stream_message_ends_the_call_invalid_argument(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    stream = raw_bytes_rpc(channel, "stream_stream", "ModelStreamInfer")
    with (
        trio.fail_after(TIMEOUT),
        caplog.at_level(logging.DEBUG, logger="trioserve"),
        pytest.raises(grpc.RpcError) as caught,
    ):
        await call(lambda: list(stream(iter([b"\xff\xff"]))))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert no_warnings(caplog)


async def test_a_bug_answers_internal_and_logs_it(
    channel: grpc.Channel, server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    served = server.repository.get("simple")

    def broken(*args: Any) -> Any:
        raise ZeroDivisionError("a bug of ours")

    served.submit = broken  # type: ignore[method-assign]
    request = service_pb2.ModelInferRequest(model_name="simple")
    infer = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer",
        request_serializer=service_pb2.ModelInferRequest.SerializeToString,
        response_deserializer=service_pb2.ModelInferResponse.FromString,
    )
    with (
        trio.fail_after(TIMEOUT),
        caplog.at_level(logging.ERROR, logger="trioserve"),
        pytest.raises(grpc.RpcError) as caught,
    ):
        await call(infer, request)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == "the call failed unexpectedly"
    (record,) = caplog.records
    assert record.exc_info is not None and isinstance(record.exc_info[1], ZeroDivisionError)


async def test_unknown_method_is_unimplemented(channel: grpc.Channel) -> None:
    unknown = channel.unary_unary("/inference.GRPCInferenceService/Nope")
    with trio.fail_after(TIMEOUT), pytest.raises(grpc.RpcError) as caught:
        await call(unknown, b"")
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_grpclib_survives_running_out_of_file_descriptors(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """An accept that fails with EMFILE is logged; asyncio pauses accepting for a second
    and the server goes on (by default trio-asyncio raises it into the nursery)."""
    config = ServerConfig(
        models=reference_zoo(), http_port=None, grpc_port=0, grpc_server="grpclib"
    )
    server: Server = await nursery.start(trioserve.serve, config)
    refused = trio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "out of system resource" in record.getMessage():
                refused.set()  # logged from an asyncio callback, in this trio run

    seen = Seen()
    logging.getLogger("trioserve.grpc").addHandler(seen)
    early = socket.socket()  # made while descriptors remain, connected once none do
    early.setblocking(False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
        try:
            early.connect_ex(("127.0.0.1", server.grpc_port))
            with trio.fail_after(TIMEOUT), caplog.at_level(logging.ERROR, "trioserve.grpc"):
                await refused.wait()
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    finally:
        early.close()
        logging.getLogger("trioserve.grpc").removeHandler(seen)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        live = channel.unary_unary(
            "/inference.GRPCInferenceService/ServerLive",
            request_serializer=service_pb2.ServerLiveRequest.SerializeToString,
            response_deserializer=service_pb2.ServerLiveResponse.FromString,
        )
        with trio.fail_after(TIMEOUT):
            reply = await call(live, service_pb2.ServerLiveRequest())
    assert reply.live


def test_invalid_argument_kind_maps_to_invalid_argument() -> None:
    assert status_of(InvalidArgumentError("bad"))[0] == GrpcStatus.INVALID_ARGUMENT
