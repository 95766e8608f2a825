"""A region whose object another process shrinks after registration: requests that use it
are refused with INVALID_ARG (400), the region stays bad, and the server lives on. Before
the checks, the first access past the new end of the file killed the process (SIGBUS)."""

from __future__ import annotations

import os
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc

from trioserve import Server

SIZE = 2 * 4096  # two pages: the second lies wholly past a truncation to one page


@pytest.fixture(scope="module")
def server(zoo_on_each_grpc_front_end: Server) -> Server:
    return zoo_on_each_grpc_front_end


def _truncate(key: str, size: int) -> None:
    """What a hostile (or careless) process does: shrink the object under the server."""
    fd = os.open(f"/dev/shm/{key.lstrip('/')}", os.O_RDWR)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _register(http: httpx.Client, regions: Any) -> str:
    handle, key = regions.create("t", SIZE)
    shm.set_shared_memory_region(handle, [np.arange(SIZE // 4, dtype=np.float32)])
    body = {"key": key, "offset": 0, "byte_size": SIZE}
    assert http.post("/v2/systemsharedmemory/region/t/register", json=body).status_code == 200
    return key


def _infer(http: httpx.Client, offset: int) -> httpx.Response:
    """identity_fp32 with its input at ``offset`` in region "t"."""
    placed = {"shared_memory_region": "t", "shared_memory_byte_size": 16,
              "shared_memory_offset": offset}  # fmt: skip
    tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [4], "parameters": placed}
    return http.post("/v2/models/identity_fp32/infer", json={"inputs": [tensor]})


def test_rest_input_in_a_truncated_region(http, regions):
    key = _register(http, regions)
    try:
        assert _infer(http, 4096).status_code == 200
        _truncate(key, 4096)
        response = _infer(http, 4096)
        assert response.status_code == 400
        assert "region 't' is no longer usable" in response.json()["error"]
        assert "shrank to 4096 bytes" in response.json()["error"]
        # The region is bad now, even for bytes the file still holds, and even once the
        # file has grown back: only registering it again makes it usable.
        _truncate(key, SIZE)
        response = _infer(http, 0)
        assert response.status_code == 400
        assert "no longer usable" in response.json()["error"]
        assert http.get("/v2/health/live").status_code == 200
    finally:
        assert http.post("/v2/systemsharedmemory/unregister").status_code == 200
    body = {"key": key, "offset": 0, "byte_size": SIZE}
    assert http.post("/v2/systemsharedmemory/region/t/register", json=body).status_code == 200
    try:
        assert _infer(http, 4096).status_code == 200
    finally:
        assert http.post("/v2/systemsharedmemory/unregister").status_code == 200


def test_grpc_input_and_output_in_a_truncated_region(server, http, regions):
    key = _register(http, regions)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            _truncate(key, 4096)
            # An input past the new end of the file.
            request = service_pb2.ModelInferRequest(model_name="identity_fp32")
            tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
            tensor.parameters["shared_memory_region"].string_param = "t"
            tensor.parameters["shared_memory_byte_size"].int64_param = 16
            tensor.parameters["shared_memory_offset"].int64_param = 4096
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "region 't' is no longer usable" in caught.value.details()
            # An output into it: refused, and the file is not grown back by the write.
            request = service_pb2.ModelInferRequest(model_name="identity_fp32")
            request.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
            request.raw_input_contents.append(np.ones(4, np.float32).tobytes())
            output = request.outputs.add(name="OUTPUT0")
            output.parameters["shared_memory_region"].string_param = "t"
            output.parameters["shared_memory_byte_size"].int64_param = 16
            output.parameters["shared_memory_offset"].int64_param = 4096
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfer(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no longer usable" in caught.value.details()
            assert os.stat(f"/dev/shm/{key.lstrip('/')}").st_size == 4096
            live = stub.ServerLive(service_pb2.ServerLiveRequest())
            assert live.live
    finally:
        assert http.post("/v2/systemsharedmemory/unregister").status_code == 200
