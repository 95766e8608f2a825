"""A server of the reference zoo and the tests' own models on either gRPC front end
(``grpc_server``), and tritonclient's client, a grpcio channel and its stub to it."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import trio
import trio.testing
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2_grpc

import trioserve
from trioserve import (
    Model,
    Server,
    ServerConfig,
)
from trioserve.models import reference_zoo

from ._harness import (
    CHANNEL_OPTIONS,
    Gate,
    Recorder,
    all_types_model,
)


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def models(gate: Gate, recorder: Recorder) -> list[Model]:
    return [*reference_zoo(), all_types_model(), gate.model(), recorder]


@pytest.fixture
async def server(nursery: trio.Nursery, models: list[Model], grpc_server: str) -> Server:
    # http_port=None: these tests must not depend on the REST front end.
    config = ServerConfig(models=models, http_port=None, grpc_port=0, grpc_server=grpc_server)
    started: Server = await nursery.start(trioserve.serve, config)
    return started


@pytest.fixture
def url(server: Server) -> str:
    return f"127.0.0.1:{server.grpc_port}"


@pytest.fixture
def client(url: str) -> Iterator[grpcclient.InferenceServerClient]:
    triton = grpcclient.InferenceServerClient(url)
    yield triton
    triton.close()


@pytest.fixture
def channel(url: str) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(url, options=CHANNEL_OPTIONS) as opened:
        yield opened


@pytest.fixture
def stub(channel: grpc.Channel) -> service_pb2_grpc.GRPCInferenceServiceStub:
    """tritonclient's own generated stub, for messages its high-level client never sends."""
    return service_pb2_grpc.GRPCInferenceServiceStub(channel)
