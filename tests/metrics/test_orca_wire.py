"""Load reports on the wire: the REST header and the gRPC trailer, over real sockets.

The REST tests run under ``mock_clock`` (time stands still unless a test moves it), so
the rates in the header are exact. The gRPC tests talk to the real clock through a
grpclib client in a thread; they check the figures that do not depend on time.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import trio
from grpclib.client import Channel
from grpclib.const import Cardinality
from tritonclient.grpc import service_pb2

import trioserve
from trioserve import GrpcLimits, HttpLimits, ServerConfig, TensorSpec
from trioserve._context import server_context
from trioserve._served import ModelRepository, ServedModel
from trioserve.grpc._generated.orca_load_report_pb2 import OrcaLoadReport
from trioserve.metrics._host_usage import HostUsage
from trioserve.metrics._orca import LoadReporter
from trioserve.rest._endpoints import build_app
from trioserve.rest._http11 import serve_http11
from trioserve.rest._hypercorn import serve_hypercorn
from trioserve.scheduler._generation import KVCacheState
from trioserve.scheduler._runner import ModelRunner

KV = KVCacheState(total_blocks=512, used_blocks=384, block_size=16)
ASK = "endpoint-load-metrics-format"


def echo_model() -> trioserve.Model:
    @trioserve.model(
        name="echo", inputs=[TensorSpec("X", "FP32", [1])], outputs=[TensorSpec("Y", "FP32", [1])]
    )
    async def echo(X: np.ndarray[Any, Any]) -> dict[str, Any]:
        return {"Y": X}

    return echo


def broken_model() -> trioserve.Model:
    @trioserve.model(
        name="broken", inputs=[TensorSpec("X", "FP32", [1])], outputs=[TensorSpec("Y", "FP32", [1])]
    )
    async def broken(X: np.ndarray[Any, Any]) -> dict[str, Any]:
        raise RuntimeError("broken on purpose")

    return broken


def reporter() -> LoadReporter:
    """A reporter whose host figures are known: no CPU figure, memory half used."""
    return LoadReporter(host=HostUsage(cpu_seconds=lambda: None, memory=lambda: 0.5))


async def start_models(nursery: trio.Nursery, served: list[ServedModel]) -> ModelRepository:
    repository = ModelRepository(served)
    await nursery.start(repository.run)
    return repository


# --- REST ---------------------------------------------------------------------------------


@pytest.fixture(params=["stdlib", "hypercorn"])
def http_server(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """Both HTTP servers: the header must pass through each."""
    return serve_http11 if request.param == "stdlib" else serve_hypercorn  # type: ignore[no-any-return]


async def serve_rest(
    nursery: trio.Nursery,
    http_server: Callable[..., Any],
    served: list[ServedModel],
    load: LoadReporter,
) -> httpx.AsyncClient:
    repository = await start_models(nursery, served)
    app = build_app(server_context(ServerConfig(), repository, load=load))
    serve_http = partial(http_server, app, "127.0.0.1", 0, HttpLimits())
    addresses = await nursery.start(app.serve_with, serve_http)
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{addresses[0][1]}")


TEXT_INPUT = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
X_INPUT = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


async def test_rest_header_for_a_kv_cache_model(
    nursery: trio.Nursery,
    mock_clock: Any,
    kv_engine: Callable[..., Any],
    http_server: Callable[..., Any],
) -> None:
    engine = kv_engine(KV)
    async with await serve_rest(nursery, http_server, [engine], reporter()) as http:
        url = "/v2/models/llm/infer"
        first = await http.post(url, json=TEXT_INPUT, headers={ASK: "json"})
        assert first.status_code == 200
        assert first.headers["endpoint-load-metrics"] == (
            'JSON {"named_metrics":{"kv_cache_utilization":0.75,"max_token_capacity":8192},'
            '"application_utilization":0.75,"rps_fractional":1.0,"eps":0.0,"mem_utilization":0.5}'
        )
        text = await http.post(url, json=TEXT_INPUT, headers={ASK: "text"})
        assert text.headers["endpoint-load-metrics"] == (
            "TEXT named_metrics.kv_cache_utilization=0.750000, "
            "named_metrics.max_token_capacity=8192"
        )
        mock_clock.jump(2.0)
        engine.kv = KVCacheState(total_blocks=512, used_blocks=128, block_size=16)
        binary = await http.post(
            url,
            json={**TEXT_INPUT, "parameters": {"binary_data_output": True}},
            headers={ASK: "json"},
        )  # three requests in the two seconds since the first; the live KV state
        assert binary.headers["content-type"] == "application/octet-stream"
        assert binary.headers["endpoint-load-metrics"] == (
            'JSON {"named_metrics":{"kv_cache_utilization":0.25,"max_token_capacity":8192},'
            '"application_utilization":0.25,"rps_fractional":1.5,"eps":0.0,"mem_utilization":0.5}'
        )


async def test_rest_no_header_unless_asked_and_possible(
    nursery: trio.Nursery,
    mock_clock: Any,
    kv_engine: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    http_server: Callable[..., Any],
) -> None:
    engine = kv_engine(KV)
    async with await serve_rest(nursery, http_server, [engine], reporter()) as http:
        url = "/v2/models/llm/infer"
        with caplog.at_level(logging.ERROR, logger="trioserve.metrics"):
            unasked = await http.post(url, json=TEXT_INPUT)
            unknown = await http.post(url, json=TEXT_INPUT, headers={ASK: "yaml"})
            engine.kv = KVCacheState(total_blocks=512, used_blocks=-1, block_size=16)
            negative = await http.post(url, json=TEXT_INPUT, headers={ASK: "json"})
            engine.kv = RuntimeError("no engine")
            missing = await http.post(url, json=TEXT_INPUT, headers={ASK: "text"})
        for response in (unasked, unknown, negative, missing):
            assert response.status_code == 200
            assert response.json()["outputs"][0]["data"] == ["hi"]  # the answer is whole
            assert "endpoint-load-metrics" not in response.headers
        assert [r.getMessage().split(":")[0] for r in caplog.records] == [
            "unknown endpoint-load-metrics-format 'yaml'",
            "model 'llm'",
            "model 'llm'",
        ]


async def test_rest_header_for_a_tensor_model(
    nursery: trio.Nursery, mock_clock: Any, http_server: Callable[..., Any]
) -> None:
    served: list[ServedModel] = [ModelRunner(echo_model(), "1"), ModelRunner(broken_model(), "1")]
    async with await serve_rest(nursery, http_server, served, reporter()) as http:
        failed = await http.post("/v2/models/broken/infer", json=X_INPUT, headers={ASK: "json"})
        assert failed.status_code == 500
        assert "endpoint-load-metrics" not in failed.headers  # errors carry no report
        ok = await http.post("/v2/models/echo/infer", json=X_INPUT, headers={ASK: "json"})
        assert ok.headers["endpoint-load-metrics"] == (
            'JSON {"named_metrics":{"num_requests_waiting":0,"num_requests_running":0},'
            '"application_utilization":0.0,"rps_fractional":2.0,"eps":1.0,"mem_utilization":0.5}'
        )
        text = await http.post("/v2/models/echo/infer", json=X_INPUT, headers={ASK: "text"})
        assert text.headers["endpoint-load-metrics"] == (
            "TEXT named_metrics.num_requests_waiting=0, named_metrics.num_requests_running=0"
        )


# --- gRPC ---------------------------------------------------------------------------------


@pytest.fixture
def serve_rpc(
    nursery: trio.Nursery, grpc_server: str, start_grpc: Callable[[Any], Awaitable[int]]
) -> Callable[[list[ServedModel], LoadReporter], Awaitable[str]]:
    """Serves models on the gRPC front end under test; the address."""

    async def serve(served: list[ServedModel], load: LoadReporter) -> str:
        repository = await start_models(nursery, served)
        config = ServerConfig(
            http_port=None,
            grpc_port=0,
            grpc_limits=GrpcLimits(max_message_bytes=1 << 24),
            grpc_server=grpc_server,
        )
        port = await start_grpc(server_context(config, repository, load=load))
        return f"127.0.0.1:{port}"

    return serve


def text_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="llm")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", 2) + b"hi")
    return request


def x_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="X", datatype="FP32", shape=[1])
    request.raw_input_contents.append(np.ones(1, np.float32).tobytes())
    return request


async def infer_with_trailers(
    url: str, request: service_pb2.ModelInferRequest, metadata: dict[str, str]
) -> dict[str, Any]:
    """ModelInfer through grpclib's client (in a thread with its own asyncio loop);
    the trailing metadata it received. grpcio cannot show ``endpoint-load-metrics-bin``:
    its core takes that key for its own load balancing and hides it from applications."""

    async def call() -> dict[str, Any]:
        host, port = url.split(":")
        channel = Channel(host, int(port))
        try:
            async with channel.request(
                "/inference.GRPCInferenceService/ModelInfer",
                Cardinality.UNARY_UNARY,
                service_pb2.ModelInferRequest,
                service_pb2.ModelInferResponse,
                metadata=metadata,
            ) as stream:
                await stream.send_message(request, end=True)
                response = await stream.recv_message()
                assert response is not None and response.raw_output_contents
                await stream.recv_trailing_metadata()
                return dict(stream.trailing_metadata or {})
        finally:
            channel.close()

    with trio.fail_after(30):
        return await trio.to_thread.run_sync(asyncio.run, call(), abandon_on_cancel=True)


async def test_grpc_trailer_parses_as_orca_load_report(
    serve_rpc: Any, kv_engine: Callable[..., Any]
) -> None:
    url = await serve_rpc([kv_engine(KV), ModelRunner(echo_model(), "1")], reporter())
    trailers = await infer_with_trailers(url, text_request(), {ASK: "json"})
    report = OrcaLoadReport.FromString(trailers["endpoint-load-metrics-bin"])
    assert dict(report.named_metrics) == {"kv_cache_utilization": 0.75, "max_token_capacity": 8192}
    assert report.application_utilization == 0.75
    assert report.rps_fractional == 1.0  # the first request, within its first second
    assert (report.eps, report.mem_utilization, report.cpu_utilization) == (0.0, 0.5, 0.0)

    trailers = await infer_with_trailers(url, x_request(), {ASK: "text"})
    report = OrcaLoadReport.FromString(trailers["endpoint-load-metrics-bin"])
    assert dict(report.named_metrics) == {"num_requests_waiting": 0, "num_requests_running": 0}
    assert report.rps_fractional > 0


async def stream_with_trailers(
    url: str, request: service_pb2.ModelInferRequest, metadata: dict[str, str]
) -> tuple[list[Any], dict[str, Any]]:
    """One request over ModelStreamInfer (grpclib's client, as above): the stream's
    responses and its trailing metadata."""

    async def call() -> tuple[list[Any], dict[str, Any]]:
        host, port = url.split(":")
        channel = Channel(host, int(port))
        try:
            async with channel.request(
                "/inference.GRPCInferenceService/ModelStreamInfer",
                Cardinality.STREAM_STREAM,
                service_pb2.ModelInferRequest,
                service_pb2.ModelStreamInferResponse,
                metadata=metadata,
            ) as stream:
                await stream.send_message(request, end=True)
                responses = [response async for response in stream]
                await stream.recv_trailing_metadata()
                return responses, dict(stream.trailing_metadata or {})
        finally:
            channel.close()

    with trio.fail_after(30):
        return await trio.to_thread.run_sync(asyncio.run, call(), abandon_on_cancel=True)


async def test_grpc_stream_trailer_reports_the_model_it_served(
    serve_rpc: Any, kv_engine: Callable[..., Any]
) -> None:
    url = await serve_rpc([kv_engine(KV)], reporter())
    responses, trailers = await stream_with_trailers(url, text_request(), {ASK: "json"})
    assert [r.error_message for r in responses] == [""]
    report = OrcaLoadReport.FromString(trailers["endpoint-load-metrics-bin"])
    assert dict(report.named_metrics) == {"kv_cache_utilization": 0.75, "max_token_capacity": 8192}
    assert report.rps_fractional == 1.0
    _, unasked = await stream_with_trailers(url, text_request(), {})
    assert "endpoint-load-metrics-bin" not in unasked


async def test_grpc_no_trailer_unless_asked_or_possible(
    serve_rpc: Any, kv_engine: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    engine = kv_engine(KV)
    url = await serve_rpc([engine], reporter())
    assert "endpoint-load-metrics-bin" not in await infer_with_trailers(url, text_request(), {})
    engine.kv = KVCacheState(total_blocks=-1, used_blocks=0, block_size=16)
    with caplog.at_level(logging.ERROR, logger="trioserve.metrics"):
        trailers = await infer_with_trailers(url, text_request(), {ASK: "json"})
    assert "endpoint-load-metrics-bin" not in trailers
    assert "negative KV-cache figures" in caplog.records[0].getMessage()


# --- one server, both front ends ----------------------------------------------------------


async def test_both_front_ends_of_a_server_share_its_load(
    nursery: trio.Nursery, mock_clock: Any, grpc_server: str
) -> None:
    config = trioserve.ServerConfig(
        models=[echo_model()], http_port=0, grpc_port=0, grpc_server=grpc_server
    )
    server: trioserve.Server = await nursery.start(trioserve.serve, config)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
        rest = await http.post("/v2/models/echo/infer", json=X_INPUT, headers={ASK: "json"})
    assert '"rps_fractional":1.0,' in rest.headers["endpoint-load-metrics"]
    trailers = await infer_with_trailers(
        f"127.0.0.1:{server.grpc_port}", x_request(), {ASK: "json"}
    )
    report = OrcaLoadReport.FromString(trailers["endpoint-load-metrics-bin"])
    assert report.rps_fractional == 2.0  # the REST request counts too: time stands still


async def test_every_front_end_counts_a_refused_request_as_an_error(
    nursery: trio.Nursery, mock_clock: Any, grpc_server: str
) -> None:
    """REST infer, ModelInfer and ModelStreamInfer count load at the same point (the one
    inference pipeline): a request the model refuses is an error on each."""
    config = trioserve.ServerConfig(
        models=[echo_model()], http_port=0, grpc_port=0, grpc_server=grpc_server
    )
    server: trioserve.Server = await nursery.start(trioserve.serve, config)
    url = f"127.0.0.1:{server.grpc_port}"
    bad = x_request()
    bad.inputs[0].datatype = "INT32"  # the model takes FP32
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.http_port}") as http:
        wrong = {"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}]}
        assert (await http.post("/v2/models/echo/infer", json=wrong)).status_code == 400
        with grpc.insecure_channel(url) as channel:
            infer = channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer",
                request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                response_deserializer=service_pb2.ModelInferResponse.FromString,
            )
            with trio.fail_after(30), pytest.raises(grpc.RpcError) as refused:
                await trio.to_thread.run_sync(infer, bad, abandon_on_cancel=True)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        responses, _ = await stream_with_trailers(url, bad, {})
        assert [bool(r.error_message) for r in responses] == [True]
        ok = await http.post("/v2/models/echo/infer", json=X_INPUT, headers={ASK: "json"})
    report = ok.headers["endpoint-load-metrics"]
    assert '"rps_fractional":4.0,"eps":3.0,' in report
