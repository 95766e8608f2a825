"""``trioserve.testing.open_grpc_channel``: gRPC over HTTP/2 in memory, through the same
core as the gRPC port, with times exact under the mock clock."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import trioserve
from trioserve import DynamicBatching, TensorSpec
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.testing import (
    GrpcCallError,
    TimedLM,
    gated,
    open_grpc_channel,
    open_test_server,
    timed,
)


@trioserve.model(
    name="double",
    inputs=[TensorSpec("X", "FP32", [1])],
    outputs=[TensorSpec("Y", "FP32", [1])],
    max_batch_size=4,
    dynamic_batching=DynamicBatching(max_queue_delay_microseconds=2000),
)
def double(X: Any) -> dict[str, Any]:
    return {"Y": 2 * X}


def double_request(value: float, request_id: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="double", id=request_id)
    request.inputs.add(name="X", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.float32([[value]]).tobytes())
    return request


def output(response: pb.ModelInferResponse) -> list[float]:
    return np.frombuffer(response.raw_output_contents[0], np.float32).tolist()


async def test_unary_calls_take_the_models_declared_time_exactly(autojump_clock: Any) -> None:
    model = timed(double, cost=0.25)
    async with open_test_server([model]) as server, open_grpc_channel(server) as channel:
        live = await channel.unary(
            "/inference.GRPCInferenceService/ServerLive",
            pb.ServerLiveRequest(),
            pb.ServerLiveResponse,
        )
        assert live.live
        start = trio.current_time()
        response = await channel.model_infer(double_request(3.0, "r1"))
        assert trio.current_time() - start == pytest.approx(0.25 + 0.002)  # cost + queue delay
        assert output(response) == [6.0]
        assert response.id == "r1"


async def test_calls_on_one_channel_share_a_batch(autojump_clock: Any) -> None:
    model = timed(double, cost=0.001)
    async with open_test_server([model]) as server, open_grpc_channel(server) as channel:
        answers: dict[int, list[float]] = {}

        async def send(i: int) -> None:
            answers[i] = output(await channel.model_infer(double_request(i)))

        async with trio.open_nursery() as clients:
            for i in range(4):
                clients.start_soon(send, i)
        assert model.batch_sizes == [4]  # four concurrent streams of one connection
        assert answers == {i: [2.0 * i] for i in range(4)}


async def test_a_deadline_ends_the_call_exactly_then(autojump_clock: Any) -> None:
    model = gated(double)
    async with open_test_server([model]) as server, open_grpc_channel(server) as channel:
        start = trio.current_time()
        with pytest.raises(GrpcCallError) as raised:
            await channel.model_infer(double_request(1.0), deadline_s=0.5)
        assert raised.value.status.name == "DEADLINE_EXCEEDED"
        assert trio.current_time() - start == pytest.approx(0.5)


async def test_errors_come_back_as_grpc_statuses(autojump_clock: Any) -> None:
    async with open_test_server([double]) as server, open_grpc_channel(server) as channel:
        request = double_request(1.0)
        request.model_name = "missing"
        with pytest.raises(GrpcCallError) as raised:
            await channel.model_infer(request)
        assert raised.value.status.name == "NOT_FOUND"
        assert "missing" in raised.value.message
        with pytest.raises(GrpcCallError) as raised:
            await channel.unary("/no.Such/Method", pb.ServerLiveRequest(), pb.ServerLiveResponse)
        assert raised.value.status.name == "UNIMPLEMENTED"


async def test_model_stream_infer_streams_each_token_on_the_clock(autojump_clock: Any) -> None:
    lm = TimedLM(step_cost=0.01)
    async with open_test_server([lm]) as server, open_grpc_channel(server) as channel:
        request = pb.ModelInferRequest(model_name=lm.name, id="s1")
        prompt = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        prompt.contents.bytes_contents.append(b"abc")
        request.parameters["max_tokens"].int64_param = 3
        start = trio.current_time()
        async with channel.model_stream_infer() as stream:
            await stream.send(request)
            await stream.done_writing()
            times, texts = [], []
            while (response := await stream.receive()) is not None:
                assert not response.error_message
                times.append(trio.current_time() - start)
                raw = response.infer_response.raw_output_contents[0]
                texts.append(raw[4:].decode())
        assert texts == ["d", "e", "f"]
        assert times == pytest.approx([0.01, 0.02, 0.03])  # one engine step each


async def test_leaving_a_stream_early_resets_it_and_the_channel_goes_on(
    autojump_clock: Any,
) -> None:
    lm = TimedLM(step_cost=1.0)
    async with open_test_server([lm, double]) as server, open_grpc_channel(server) as channel:
        async with channel.model_stream_infer() as stream:
            request = pb.ModelInferRequest(model_name=lm.name)
            prompt = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
            prompt.contents.bytes_contents.append(b"abc")
            await stream.send(request)
        response = await channel.model_infer(double_request(2.0))
        assert output(response) == [4.0]
