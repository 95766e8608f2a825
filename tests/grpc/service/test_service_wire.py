"""The gRPC front end against messages tritonclient's high-level client never sends,
through its generated stub: each datatype's typed contents, malformed requests (each
refused INVALID_ARGUMENT with what is wrong, the server carrying on), inference errors,
and the trace and log settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
import trio
import trio.testing
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor

from ._harness import (
    TIMEOUT,
    Client,
    call,
    expect_error,
    expect_rpc_error,
    infer_input,
    simple_inputs,
)

# --- hand-built requests: typed contents and malformed messages ----------------------

# The typed contents field of each datatype that has one, and values that fill it.
TYPED = {
    "BOOL": ("bool_contents", [True, False]),
    "UINT8": ("uint_contents", [0, 255]),
    "UINT16": ("uint_contents", [0, 65535]),
    "UINT32": ("uint_contents", [0, 2**32 - 1]),
    "UINT64": ("uint64_contents", [0, 2**64 - 1]),
    "INT8": ("int_contents", [-128, 127]),
    "INT16": ("int_contents", [-(2**15), 2**15 - 1]),
    "INT32": ("int_contents", [-(2**31), 2**31 - 1]),
    "INT64": ("int64_contents", [-(2**63), 2**63 - 1]),
    "FP32": ("fp32_contents", [0.5, -1.25]),
    "FP64": ("fp64_contents", [0.1, -1e300]),
    "BYTES": ("bytes_contents", [b"\x00", b"\xff\xfe"]),
}


def typed_input(
    request: Any, datatype: str, values: list[Any], name: str | None = None, shape: Any = None
) -> Any:
    tensor = request.inputs.add(
        name=name or f"IN_{datatype}",
        datatype=datatype,
        shape=[len(values)] if shape is None else shape,
    )
    field = TYPED[datatype][0] if datatype in TYPED else "fp32_contents"
    getattr(tensor.contents, field).extend(values)
    return tensor


def raw_output(response: Any, name: str) -> list[Any]:
    index = [o.name for o in response.outputs].index(name)
    output, raw = response.outputs[index], response.raw_output_contents[index]
    if output.datatype == "BYTES":
        return deserialize_bytes_tensor(raw).tolist()  # type: ignore[no-any-return]
    dtype = "?" if output.datatype == "BOOL" else output.datatype.lower().replace("fp", "float")
    return np.frombuffer(raw, dtype=dtype).tolist()  # type: ignore[no-any-return]


async def test_typed_contents(stub: Any) -> None:
    request = service_pb2.ModelInferRequest(model_name="all_types", id="typed")
    for dt, (_, values) in TYPED.items():
        typed_input(request, dt, values)
        request.outputs.add(name=f"OUT_{dt}")
    with trio.fail_after(TIMEOUT):
        response = await call(stub.ModelInfer, request)
    assert response.id == "typed"
    assert len(response.raw_output_contents) == len(TYPED)
    for dt, (_, values) in TYPED.items():
        got = raw_output(response, f"OUT_{dt}")
        if dt == "FP32":
            values = np.array(values, dtype=np.float32).tolist()
        assert got == values, dt


def _malformed() -> list[Any]:
    def case(build: Callable[[Any], None], id: str, says: str) -> Any:
        request = service_pb2.ModelInferRequest(model_name="all_types")
        build(request)
        return pytest.param(request, says, id=id)

    def both(r: Any) -> None:
        typed_input(r, "INT32", [1])
        r.raw_input_contents.append(b"\x01\x00\x00\x00")

    def raw_count(r: Any) -> None:
        r.inputs.add(name="IN_INT32", datatype="INT32", shape=[1])
        r.inputs.add(name="IN_INT8", datatype="INT8", shape=[1])
        r.raw_input_contents.append(b"\x01\x00\x00\x00")

    def wrong_field(r: Any) -> None:
        r.inputs.add(name="IN_INT32", datatype="INT32", shape=[1]).contents.fp32_contents.append(1)

    def raw_size(r: Any) -> None:
        r.inputs.add(name="IN_INT32", datatype="INT32", shape=[2])
        r.raw_input_contents.append(b"\x01\x00\x00\x00")

    def bad_bool(r: Any) -> None:
        r.inputs.add(name="IN_BOOL", datatype="BOOL", shape=[1])
        r.raw_input_contents.append(b"\x02")

    def extra_raw(r: Any) -> None:
        r.inputs.add(name="IN_INT32", datatype="INT32", shape=[1])
        r.raw_input_contents.extend([b"\x01\x00\x00\x00", b"\x02\x00\x00\x00"])

    def negative_priority(r: Any) -> None:
        typed_input(r, "INT32", [1])
        r.parameters["priority"].int64_param = -1

    def double_timeout(r: Any) -> None:
        typed_input(r, "INT32", [1])
        r.parameters["timeout"].double_param = 1.5

    def empty_parameter(r: Any) -> None:
        typed_input(r, "INT32", [1])
        r.parameters["k"].SetInParent()  # an InferParameter with no value set

    def duplicate(r: Any) -> None:
        typed_input(r, "INT32", [1])
        typed_input(r, "INT32", [2])

    return [
        case(lambda r: typed_input(r, "INT32", [1, 2], shape=[3]), "count-mismatch", "needs 3"),
        case(
            lambda r: typed_input(r, "FP16", [1.0]),
            "fp16-typed",
            "only be sent as raw_input_contents",
        ),
        case(lambda r: typed_input(r, "INT8", [300]), "int8-out-of-range", "out of range for INT8"),
        case(lambda r: typed_input(r, "FP8", [1.0]), "bad-datatype", "invalid datatype 'FP8'"),
        case(
            lambda r: typed_input(r, "INT32", [1], shape=[-1]),
            "negative-shape",
            "non-negative integers",
        ),
        case(
            lambda r: r.inputs.add(name="IN_INT32", datatype="INT32", shape=[1]),
            "no-data",
            "unable to find data for input tensor 'IN_INT32'",
        ),
        case(both, "raw-and-contents", "contents field must not be specified"),
        case(raw_count, "raw-count", "unable to find data for input tensor 'IN_INT8'"),
        case(wrong_field, "wrong-contents-field", "fp32_contents does not carry INT32"),
        case(raw_size, "raw-size", "needs 8"),
        case(bad_bool, "bad-bool", "BOOL data must be bytes 0 or 1"),
        case(extra_raw, "extra-raw", "2 raw_input_contents for 1 inputs"),
        case(negative_priority, "negative-priority", "expected value >= 0"),
        case(double_timeout, "double-timeout", "'timeout' parameter"),
        case(empty_parameter, "empty-parameter", "parameter 'k' has no value"),
        case(duplicate, "duplicate-input", "appears twice"),
    ]


@pytest.mark.parametrize(("request_message", "says"), _malformed())
async def test_malformed_request(
    stub: Any, client: Client, request_message: Any, says: str
) -> None:
    with trio.fail_after(TIMEOUT):
        message = await expect_rpc_error(
            grpc.StatusCode.INVALID_ARGUMENT, stub.ModelInfer, request_message
        )
        assert says in message
        assert await call(client.is_server_live)  # and the server carries on


@pytest.mark.parametrize(
    ("model", "version", "inputs", "outputs", "status"),
    [
        ("nope", "", "simple", None, "NOT_FOUND"),
        ("simple", "9", "simple", None, "NOT_FOUND"),
        ("simple", "", "unknown-input", None, "INVALID_ARGUMENT"),
        ("simple", "", "wrong-shape", None, "INVALID_ARGUMENT"),
        ("simple", "", "wrong-datatype", None, "INVALID_ARGUMENT"),
        ("simple", "", "too-many-rows", None, "INVALID_ARGUMENT"),
        ("simple", "", "simple", "NOPE", "INVALID_ARGUMENT"),
        ("simple", "", "shared-memory", None, "NOT_FOUND"),  # no region called "region"
    ],
)
async def test_infer_errors(
    client: Client, model: str, version: str, inputs: str, outputs: str | None, status: str
) -> None:
    built, a = simple_inputs(9 if inputs == "too-many-rows" else 1)
    if inputs == "unknown-input":
        built.append(infer_input("INPUT9", a, "INT32"))
    elif inputs == "wrong-shape":
        built[0] = infer_input("INPUT0", a[:, :15], "INT32")
    elif inputs == "wrong-datatype":
        built[0] = infer_input("INPUT0", a.astype(np.float32), "FP32")
    elif inputs == "shared-memory":
        built[0].set_shared_memory("region", 64)
    requested = [grpcclient.InferRequestedOutput(outputs)] if outputs else None
    with trio.fail_after(TIMEOUT):
        message = await expect_error(
            status, client.infer, model, built, model_version=version, outputs=requested
        )
    if model == "nope":
        assert message == "Request for unknown model: 'nope' is not found"
    assert message


async def test_trace_and_log_settings_answer(stub: Any) -> None:
    with trio.fail_after(TIMEOUT):
        trace = await call(stub.TraceSetting, service_pb2.TraceSettingRequest())
        logs = await call(stub.LogSettings, service_pb2.LogSettingsRequest())
    assert list(trace.settings["trace_level"].value) == ["OFF"]
    assert trace.settings["trace_mode"].value == ["triton"]
    assert logs.settings["log_verbose_level"].uint32_param == 0
    assert logs.settings["log_format"].string_param == "default"
