"""ModelInfer's messages split around their tensors: the same requests and replies as
protobuf's own parse and serialization, with the tensors as views."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve._errors import InvalidArgumentError
from trioserve._tensor import datatype
from trioserve._types import InferenceResponse, OutputTensor
from trioserve.grpc._codec import decode_request, encode_response, response_head
from trioserve.grpc._errors import GrpcError
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.grpc._infer_wire import InferPlans, ReplyHeads, WireRequest, stream_reply
from trioserve.shm import RequestRegions, SharedMemoryRegistry

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


def request_message(draw: Any) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(
        model_name=draw(names), model_version=draw(st.sampled_from(["", "1"])), id=draw(names)
    )
    for index in range(draw(st.integers(0, 4))):
        count = draw(st.integers(0, 6))
        message.inputs.add(name=f"IN{index}", datatype="INT32", shape=[count])
        message.raw_input_contents.append(np.arange(count, dtype=np.int32).tobytes())
    if draw(st.booleans()):
        message.parameters["priority"].int64_param = draw(st.integers(0, 5))
    if draw(st.booleans()):
        message.outputs.add(name="OUT0")
    return message


@st.composite
def requests(draw: Any) -> pb.ModelInferRequest:
    return request_message(draw)


def decoded(request: Any) -> Any:
    """A request as plain values, for comparing two decodes."""
    return (
        request.model_name,
        request.model_version,
        request.id,
        dict(request.parameters),
        [(o.name, dict(o.parameters)) for o in request.outputs],
        {
            name: (t.datatype.name, t.shape, t.data.tolist(), dict(t.parameters))
            for name, t in request.inputs.items()
        },
    )


@settings(max_examples=150, deadline=None)
@given(requests())
def test_split_request_decodes_as_protobuf_does(message: pb.ModelInferRequest) -> None:
    data = message.SerializeToString()
    wire = WireRequest.FromString(data)
    assert [bytes(raw) for raw in wire.raw] == list(message.raw_input_contents)
    head = pb.ModelInferRequest.FromString(wire.head)
    head.raw_input_contents.extend(message.raw_input_contents)
    assert head == message
    plans = InferPlans()
    registry = SharedMemoryRegistry()
    expected = decoded(decode_request(message, RequestRegions(registry, "cpu")))
    for _ in range(3):  # the first decode makes the plan, later ones use it
        plan = plans.plan(WireRequest.FromString(data))
        assert (plan.model_name, plan.model_version) == (message.model_name, message.model_version)
        request = plan.decode(WireRequest.FromString(data).raw, RequestRegions(registry, "cpu"))
        assert decoded(request) == expected


def test_raw_inputs_are_views_of_the_received_bytes() -> None:
    tensor = np.arange(1024, dtype=np.float32)
    message = pb.ModelInferRequest(model_name="m", raw_input_contents=[tensor.tobytes()])
    message.inputs.add(name="IN", datatype="FP32", shape=[1024])
    received = bytearray(message.SerializeToString())
    wire = WireRequest.FromString(received)
    plans = InferPlans()
    regions = RequestRegions(SharedMemoryRegistry(), "cpu")
    for _ in range(2):
        array = plans.plan(wire).decode(wire.raw, regions).inputs["IN"].data
        assert np.shares_memory(array, np.frombuffer(received, dtype=np.uint8))
        assert array.tolist() == tensor.tolist()


def test_a_known_head_still_checks_each_requests_tensors() -> None:
    message = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\0" * 8])
    message.inputs.add(name="IN", datatype="INT32", shape=[2])
    plans = InferPlans()
    regions = RequestRegions(SharedMemoryRegistry(), "cpu")
    good = WireRequest.FromString(message.SerializeToString())
    plans.plan(good).decode(good.raw, regions)
    message.raw_input_contents[0] = b"\0" * 12  # same head, wrong size
    bad = WireRequest.FromString(message.SerializeToString())
    with pytest.raises(InvalidArgumentError, match="needs 8"):
        plans.plan(bad).decode(bad.raw, regions)
    del message.raw_input_contents[:]  # same head, no tensor at all
    missing = WireRequest.FromString(message.SerializeToString())
    with pytest.raises(InvalidArgumentError, match="unable to find data"):
        plans.plan(missing).decode(missing.raw, regions)


@pytest.mark.parametrize(
    "data", [b"\x0a", b"\x0a\x05ab", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0b"]
)
def test_malformed_top_level_is_a_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        WireRequest.FromString(data)


def test_malformed_head_is_invalid_argument() -> None:
    wire = WireRequest(b"\x2a\x03\xff\xff\xff", [])  # inputs: a broken sub-message
    with pytest.raises(GrpcError, match="malformed request message"):
        InferPlans().plan(wire)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(names, st.integers(0, 5) | st.just(2000)), max_size=4),
    names,
    st.booleans(),
)
def test_reply_in_parts_is_protobufs_reply(
    outputs: list[tuple[str, int]], request_id: str, with_parameter: bool
) -> None:
    response = InferenceResponse(
        "model",
        "1",
        [
            OutputTensor(name, datatype("FP32"), np.arange(count, dtype=np.float32))
            for name, count in outputs
        ],
        request_id,
        {"sequence_end": True} if with_parameter else {},
    )
    heads = ReplyHeads()
    for _ in range(2):  # the second reply reuses the head
        reply = heads.encode(response)
        parsed = pb.ModelInferResponse.FromString(reply.SerializeToString())
        assert parsed == encode_response(response)
    data_parts = [part for part in reply.parts if isinstance(part, memoryview)]
    # Large tensors are views, not copies; small ones are copied (one call, not four).
    assert len(data_parts) == sum(count == 2000 for _, count in outputs)
    # A stream's reply, the same in parts inside a ModelStreamInferResponse.
    streamed = pb.ModelStreamInferResponse.FromString(
        stream_reply(response_head(response), response.outputs).SerializeToString()
    )
    assert streamed == pb.ModelStreamInferResponse(infer_response=encode_response(response))
