"""At most ``max_shared_memory_regions`` regions are registered at once (REST and gRPC
share the count): past it registering is refused with a clear error, and opens nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from trioserve import Server, ServerConfig
from trioserve._cli import _parser, config_from_args
from trioserve.testing import server_in_thread

LIMIT = 3


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    config = ServerConfig(http_port=0, grpc_port=0, max_shared_memory_regions=LIMIT)
    with server_in_thread(config) as running:
        yield running


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_registering_past_the_limit(server, regions):
    _, key = regions.create("limit", 64)
    body = {"key": key, "offset": 0, "byte_size": 64}
    with (
        httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}") as http,
        grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel,
    ):
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            for index in range(LIMIT - 1):
                path = f"/v2/systemsharedmemory/region/r{index}/register"
                assert http.post(path, json=body).status_code == 200
            request = service_pb2.SystemSharedMemoryRegisterRequest(
                name="last", key=key, offset=0, byte_size=64
            )
            stub.SystemSharedMemoryRegister(request)
            # Full: neither transport registers another, and nothing is opened trying.
            descriptors = _open_descriptors()
            refused = http.post("/v2/systemsharedmemory/region/more/register", json=body)
            assert refused.status_code == 400
            assert refused.json()["error"] == (
                "failed to register shared memory region 'more': 3 regions are registered, "
                "the most this server allows; unregister one first"
            )
            request.name = "more"
            with pytest.raises(grpc.RpcError) as caught:
                stub.SystemSharedMemoryRegister(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "3 regions are registered" in caught.value.details()
            assert _open_descriptors() == descriptors
            assert len(http.get("/v2/systemsharedmemory/status").json()) == LIMIT
            # Unregistering one makes room again.
            assert http.post("/v2/systemsharedmemory/region/r0/unregister").status_code == 200
            stub.SystemSharedMemoryRegister(request)
        finally:
            assert http.post("/v2/systemsharedmemory/unregister").status_code == 200


def test_the_flag():
    config = config_from_args(_parser().parse_args(["run", "--max-shared-memory-regions", "7"]))
    assert config.max_shared_memory_regions == 7
    assert config_from_args(_parser().parse_args(["run"])).max_shared_memory_regions == 256
    with pytest.raises(ValueError, match="max_shared_memory_regions"):
        ServerConfig(max_shared_memory_regions=-1)
