"""Bad requests get the answer one process gives, status and message, through
``--workers 2``: inference requests that the worker decodes (the fast path) and the core
validates, or that the worker refuses itself, and requests to the other endpoints, which
the worker forwards as they came or refuses itself (routes, methods, encodings); either
way the client cannot tell."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from ._served import TIMEOUT, Served


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Served, Served]]:
    one = Served(workers=0)
    try:
        two = Served(workers=2)
        try:
            yield one, two
        finally:
            assert two.stop() == 0
    finally:
        assert one.stop() == 0
    # Refused, every one: no process logged an error of its own.
    errors = [line for line in one.log + two.log if " ERROR " in line]
    assert not errors, "".join(errors)


def _tensor(name: str, shape: tuple[int, ...] = (1, 16), datatype: str = "INT32", **kw: Any) -> Any:
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": list(range(16)), **kw}


_BOTH = [_tensor("INPUT0"), _tensor("INPUT1")]
_NINE = [_tensor(f"INPUT{i}", (9, 16), data=list(range(144))) for i in (0, 1)]
_BINARY_HEAD = json.dumps({"inputs": [
    {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
    {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 60}},
]}).encode()  # fmt: skip

# (model, body, Inference-Header-Content-Length or None)
REST_CASES: dict[str, tuple[str, bytes, int | None]] = {
    "malformed JSON": ("simple", b"{not json", None),
    "no inputs": ("simple", json.dumps({"inputs": []}).encode(), None),
    "an input missing": ("simple", json.dumps({"inputs": _BOTH[:1]}).encode(), None),
    "wrong datatype": ("simple", json.dumps({"inputs": [_BOTH[0], _tensor("INPUT1", datatype="FP32")]}).encode(), None),
    "wrong shape": ("simple", json.dumps({"inputs": [_BOTH[0], _tensor("INPUT1", (1, 8), data=list(range(8)))]}).encode(), None),
    "too few elements": ("simple", json.dumps({"inputs": [_BOTH[0], _tensor("INPUT1", data=list(range(15)))]}).encode(), None),
    "strings for INT32": ("simple", json.dumps({"inputs": [_BOTH[0], _tensor("INPUT1", data=["a"] * 16)]}).encode(), None),
    "out of range": ("simple", json.dumps({"inputs": [_BOTH[0], _tensor("INPUT1", data=[2**40] * 16)]}).encode(), None),
    "unknown output": ("simple", json.dumps({"inputs": _BOTH, "outputs": [{"name": "NOPE"}]}).encode(), None),
    "unknown input": ("simple", json.dumps({"inputs": [*_BOTH, _tensor("INPUT2")]}).encode(), None),
    "batch too large": ("simple", json.dumps({"inputs": _NINE}).encode(), None),
    "unknown model": ("nosuch", json.dumps({"inputs": _BOTH}).encode(), None),
    "bad priority": ("simple", json.dumps({"inputs": _BOTH, "parameters": {"priority": "x"}}).encode(), None),
    "negative timeout": ("simple", json.dumps({"inputs": _BOTH, "parameters": {"timeout": -1}}).encode(), None),
    "id not a string": ("simple", json.dumps({"id": 5, "inputs": _BOTH}).encode(), None),
    "classification": ("simple", json.dumps({"inputs": _BOTH, "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 2}}]}).encode(), None),
    "binary data past the body": ("simple", json.dumps({"inputs": [_BOTH[0], {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}}]}).encode(), None),
    "binary data too short": ("simple", _BINARY_HEAD + bytes(124), len(_BINARY_HEAD)),
    "header length past the body": ("simple", _BINARY_HEAD + bytes(124), 99999),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REST_CASES))
def test_a_bad_rest_request_is_refused_as_one_process_refuses_it(
    servers: tuple[Served, Served], case: str
) -> None:
    model, body, header_length = REST_CASES[case]
    headers = (
        {} if header_length is None else {"Inference-Header-Content-Length": str(header_length)}
    )
    answers = []
    for served in servers:
        reply = httpx.post(
            f"http://{served.url}/v2/models/{model}/infer", content=body, headers=headers,
            timeout=TIMEOUT,
        )  # fmt: skip
        answers.append((reply.status_code, reply.json()))
    assert answers[0][0] >= 400 and "error" in answers[0][1], answers[0]
    assert answers[1] == answers[0]


def _request(
    model: str = "simple",
    shapes: tuple[tuple[int, ...], ...] = ((1, 16), (1, 16)),
    datatypes: tuple[str, ...] = ("INT32", "INT32"),
    raws: list[bytes] | None = None,
    outputs: tuple[str, ...] = (),
) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model)
    for index, (shape, datatype) in enumerate(zip(shapes, datatypes, strict=True)):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = f"INPUT{index}", datatype
        tensor.shape.extend(shape)
    one = np.arange(16, dtype=np.int32).tobytes()
    request.raw_input_contents.extend([one] * len(shapes) if raws is None else raws)
    for name in outputs:
        request.outputs.add().name = name
    return request


_Setting = service_pb2.TraceSettingRequest.SettingValue
_LogSetting = service_pb2.LogSettingsRequest.SettingValue

# (method, request): ModelInfer's the worker decodes, the others it forwards as they came.
GRPC_CASES: dict[str, tuple[str, Any]] = {
    "unknown model": ("ModelInfer", _request(model="nosuch")),
    "wrong datatype": ("ModelInfer", _request(datatypes=("INT32", "FP32"))),
    "an input missing": ("ModelInfer", _request(shapes=((1, 16),), datatypes=("INT32",))),
    "raw contents missing": ("ModelInfer", _request(raws=[bytes(64)])),
    "raw contents too short": ("ModelInfer", _request(raws=[bytes(64), bytes(60)])),
    "unknown output": ("ModelInfer", _request(outputs=("NOPE",))),
    "batch too large": ("ModelInfer", _request(shapes=((9, 16), (9, 16)), raws=[bytes(576)] * 2)),
    "metadata of an unknown model": ("ModelMetadata", service_pb2.ModelMetadataRequest(name="nosuch")),
    "config of an unknown model": ("ModelConfig", service_pb2.ModelConfigRequest(name="nosuch")),
    "statistics of an unknown model": ("ModelStatistics", service_pb2.ModelStatisticsRequest(name="nosuch")),
    "a region that is not there": ("SystemSharedMemoryRegister", service_pb2.SystemSharedMemoryRegisterRequest(name="r1", key="/trioserve-test-no-such-region", byte_size=64)),
    "status of an unknown region": ("SystemSharedMemoryStatus", service_pb2.SystemSharedMemoryStatusRequest(name="nosuch")),
    "a load without model control": ("RepositoryModelLoad", service_pb2.RepositoryModelLoadRequest(model_name="nosuch")),
    "a bad trace setting": ("TraceSetting", service_pb2.TraceSettingRequest(settings={"trace_rate": _Setting(value=["x"])})),
    "a bad log setting": ("LogSettings", service_pb2.LogSettingsRequest(settings={"log_verbose_level": _LogSetting(string_param="x")})),
}  # fmt: skip


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_a_bad_grpc_request_is_refused_as_one_process_refuses_it(
    servers: tuple[Served, Served], case: str
) -> None:
    method, request = GRPC_CASES[case]
    answers = []
    for served in servers:
        with grpc.insecure_channel(served.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                getattr(stub, method)(request, timeout=TIMEOUT)
        answers.append((refused.value.code(), refused.value.details()))
    assert answers[1] == answers[0]


def test_a_bad_request_on_a_stream_is_answered_as_one_process_answers_it(
    servers: tuple[Served, Served],
) -> None:
    answers = []
    for served in servers:
        with grpc.insecure_channel(served.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            replies = stub.ModelStreamInfer(iter([_request(model="nosuch")]), timeout=TIMEOUT)
            answers.append([reply.error_message for reply in replies])
    assert answers[0] == ["Request for unknown model: 'nosuch' is not found"]
    assert answers[1] == answers[0]


_SHM_INPUT = {
    "name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
    "parameters": {"shared_memory_region": "nosuch", "shared_memory_byte_size": 64},
}  # fmt: skip
_OCTETS = {"Content-Type": "application/octet-stream"}

# (method, path, body, headers): what the worker forwards as it came, or refuses itself.
OTHER_CASES: list[tuple[str, str, bytes, dict[str, str]]] = [
    ("GET", "/v2/models/nosuch", b"", {}),
    ("GET", "/v2/models/nosuch/config", b"", {}),
    ("GET", "/v2/models/nosuch/stats", b"", {}),
    ("GET", "/v2/models/simple/versions/7", b"", {}),
    ("POST", "/v2/systemsharedmemory/region/r1/register", b'{"key": "/trioserve-test-no-such-region", "offset": 0, "byte_size": 64}', {}),
    ("POST", "/v2/systemsharedmemory/region/r1/register", b'{"key": 5}', {}),
    ("POST", "/v2/models/simple/infer", json.dumps({"inputs": [_SHM_INPUT, _BOTH[1]]}).encode(), {}),
    ("POST", "/v2/models/simple/infer", bytes(64), _OCTETS),
    ("POST", "/v2/repository/models/nosuch/load", b"", {}),
    ("POST", "/v2/repository/models/simple/unload", b'{"parameters": {"unload_dependents": "x"}}', {}),
    ("POST", "/v2/repository/index", b"{bad", {}),
    ("POST", "/v2/models/tiny_lm/generate", b'{"text_input": "hi", "parameters": {"temperature": -1}}', {}),
    ("POST", "/v2/models/tiny_lm/generate", b'{"parameters": {"max_tokens": 2}}', {}),
    ("POST", "/v2/models/simple/generate", b'{"text_input": "hi"}', {}),
    ("POST", "/v1/chat/completions", b'{"model": "tiny_lm"}', {}),
    ("POST", "/v1/chat/completions", b'{"model": "nosuch", "messages": [{"role": "user", "content": "hi"}]}', {}),
    ("POST", "/v1/completions", b'{"model": "tiny_lm", "prompt": "hi", "n": 0}', {}),
    ("POST", "/v2/trace/setting", b'{"trace_rate": "x"}', {}),
    ("POST", "/v2/logging", b'{"log_verbose_level": "x"}', {}),
    ("GET", "/v2/nothing/here", b"", {}),
    ("GET", "/v2/models/simple/infer", b"", {}),
    ("DELETE", "/v2", b"", {}),
    ("POST", "/v2/models/simple/infer", b"{}", {"Content-Encoding": "gzip"}),
    ("POST", "/v2/models/simple/infer", b"{}", {"Content-Encoding": "zstd-nope"}),
]  # fmt: skip


@pytest.mark.parametrize(
    "case",
    OTHER_CASES,
    ids=[f"{method} {path} {index}" for index, (method, path, _, _) in enumerate(OTHER_CASES)],
)
def test_a_bad_request_to_another_endpoint_is_refused_as_one_process_refuses_it(
    servers: tuple[Served, Served], case: tuple[str, str, bytes, dict[str, str]]
) -> None:
    method, path, body, headers = case
    answers = []
    for served in servers:
        reply = httpx.request(
            method, f"http://{served.url}{path}", content=body, headers=headers, timeout=TIMEOUT
        )
        answers.append((reply.status_code, reply.text))
    assert answers[0][0] >= 400 and "error" in answers[0][1], answers[0]
    assert answers[1] == answers[0]
