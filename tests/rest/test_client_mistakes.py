"""Client mistakes that once reached the server as 500/INTERNAL with a logged traceback:
each is a clear 400 (INVALID_ARGUMENT on gRPC), and nothing is logged as a failure."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

import trioserve
from trioserve import Server, ServerConfig, TensorSpec
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread


@trioserve.model(
    name="identity_int64",
    inputs=[TensorSpec("INPUT0", "INT64", [-1])],
    outputs=[TensorSpec("OUTPUT0", "INT64", [-1])],
)
def identity_int64(INPUT0: Any) -> dict[str, Any]:
    return {"OUTPUT0": INPUT0}


@pytest.fixture(scope="module", params=["stdlib", "hypercorn"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    config = ServerConfig(
        models=[*reference_zoo(), identity_int64],
        http_port=0,
        grpc_port=0,
        http_server=request.param,
    )
    with server_in_thread(config) as running:
        yield running


def _input(datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": shape, "data": data}]}


DEEP = "[" * 100_000 + "]" * 100_000
FP32_ONE = _input("FP32", [1], [1.0])


@pytest.mark.parametrize(
    ("model", "body", "says"),
    [
        ("identity_fp32", DEEP, "nested too deeply"),
        ("identity_fp32", '{"inputs": ' + DEEP + "}", "nested too deeply"),
        ("identity_fp32", _input("FP32", [0, 2**62], []), "is too large"),
        ("identity_fp32", _input("FP32", [1] * 65, [1.0]), "65 dimensions, at most 64"),
        ("identity_int64", _input("INT64", [1], [2**64]), "out of range for INT64"),
        ("identity_int64", _input("INT64", [1], [[2**64]]), "out of range for INT64"),
        ("identity_int64", _input("INT64", [300], [2**64] + [1] * 299), "out of range"),
        ("identity_int64", _input("INT64", [2], [[2**63, -1]]), "out of range"),
        # Found by tests/test_fuzz.py: the midpoint between FP32's largest value and 2**128
        # rounds to infinity.
        ("identity_fp32", _input("FP32", [1], [3.4028235677973366e38]), "out of range for FP32"),
        ("identity_fp32", _input("FP32", [1, 2], [[1.0, 1e39]]), "out of range for FP32"),
        ("identity_bytes", '{"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1], '
         '"data": ["\\ud800"]}]}', "not valid Unicode"),
        ("identity_fp32", {**FP32_ONE, "parameters": {"binary_data_output": "false"}},
         "'binary_data_output' must be a boolean"),
        ("identity_fp32", {**FP32_ONE, "outputs": [{"name": "OUTPUT0",
                                                    "parameters": {"binary_data": 0}}]},
         "'binary_data' must be a boolean"),
    ],
)  # fmt: skip
def test_rest(http, caplog, model, body, says):
    content = body if isinstance(body, str) else json.dumps(body)
    response = http.post(f"/v2/models/{model}/infer", content=content)
    assert response.status_code == 400
    assert says in response.json()["error"]
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_rest_flags_still_work(http):
    as_json = http.post("/v2/models/identity_fp32/infer",
                        json={**FP32_ONE, "parameters": {"binary_data_output": False}})  # fmt: skip
    assert as_json.json()["outputs"][0]["data"] == [1.0]
    as_binary = http.post("/v2/models/identity_fp32/infer",
                          json={**FP32_ONE, "parameters": {"binary_data_output": True}})  # fmt: skip
    assert "inference-header-content-length" in as_binary.headers
    largest = http.post("/v2/models/identity_int64/infer",
                        json=_input("INT64", [2], [[2**63 - 1, -(2**63)]]))  # fmt: skip
    assert largest.json()["outputs"][0]["data"] == [2**63 - 1, -(2**63)]


@pytest.mark.parametrize(
    ("shape", "says"), [([0, 2**62], "is too large"), ([1] * 65, "at most 64")]
)
def test_grpc_shapes(server, caplog, shape, says):
    request = service_pb2.ModelInferRequest(model_name="identity_fp32")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=shape)
    request.raw_input_contents.append(np.ones(shape[0], np.float32).tobytes())
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in caught.value.details()
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
