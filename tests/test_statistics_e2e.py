"""Statistics, metrics and the response cache end to end, through Triton's own clients.

One real server (HTTP, gRPC and a separate metrics port, all on 127.0.0.1 port 0) serves
the reference zoo plus a model that uses the response cache; tritonclient drives it. Once
with each HTTP server (ours and Hypercorn).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf.json_format import ParseDict
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

import trioserve
from trioserve import MetricsConfig, Server, ServerConfig, TensorSpec
from trioserve._stats import FailureReason
from trioserve._tensor import datatype
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread


@trioserve.model(
    name="cached_square",
    inputs=[TensorSpec("X", "FP32", [-1])],
    outputs=[TensorSpec("Y", "FP32", [-1])],
    response_cache=True,
)
def cached_square(X):
    return {"Y": X * X}


@pytest.fixture(scope="module", params=["stdlib", "hypercorn"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    config = ServerConfig(
        models=[*reference_zoo(), cached_square],
        http_server=request.param,
        http_port=0,
        grpc_port=0,
        metrics=MetricsConfig(port=0),
        response_cache_bytes=1 << 20,
    )
    with server_in_thread(config) as running:
        yield running


@pytest.fixture(scope="module")
def clients(server: Server):
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    _traffic(http, grpc)
    yield http, grpc
    http.close()
    grpc.close()


def _simple_inputs(module):
    x = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in (0, 1)]
    for tensor in inputs:
        tensor.set_data_from_numpy(x)
    return inputs


def _traffic(http, grpc) -> None:
    """simple: 3 over HTTP + 1 over gRPC; fail: 1 error; cached_square: a miss, then a hit."""
    for _ in range(3):
        http.infer("simple", _simple_inputs(httpclient))
    grpc.infer("simple", _simple_inputs(grpcclient))
    failing = httpclient.InferInput("INPUT0", [1], "INT32")
    failing.set_data_from_numpy(np.array([1], dtype=np.int32))
    with pytest.raises(InferenceServerException):
        http.infer("fail", [failing])
    for _ in range(2):
        x = httpclient.InferInput("X", [3], "FP32")
        x.set_data_from_numpy(np.array([1, 2, 3], dtype=np.float32))
        assert http.infer("cached_square", [x]).as_numpy("Y").tolist() == [1, 4, 9]


def _by_model(document) -> dict[tuple[str, str], dict]:
    return {(s["name"], s["version"]): s for s in document["model_stats"]}


def test_http_and_grpc_report_the_same_statistics(clients):
    http, grpc = clients
    for name, version in [("", ""), ("simple", ""), ("simple", "1"), ("cached_square", "1")]:
        over_http = http.get_inference_statistics(name, version)
        over_grpc = grpc.get_inference_statistics(name, version)
        assert ParseDict(over_http, service_pb2.ModelStatisticsResponse()) == over_grpc
    stats = _by_model(http.get_inference_statistics())
    assert set(stats) == {(m.name, "1") for m in [*reference_zoo(), cached_square]}
    simple = stats[("simple", "1")]
    assert simple["inference_stats"]["success"]["count"] == 4
    assert simple["inference_count"] == 4 and simple["execution_count"] == 4
    assert simple["inference_stats"]["success"]["ns"] > 0
    assert simple["batch_stats"][0]["batch_size"] == 1 and simple["last_inference"] > 0
    fail = stats[("fail", "1")]["inference_stats"]
    assert fail["fail"]["count"] == 1 and fail["success"]["count"] == 0
    cached = stats[("cached_square", "1")]
    assert cached["inference_stats"]["cache_hit"]["count"] == 1
    assert cached["inference_stats"]["cache_miss"]["count"] == 1
    assert cached["inference_stats"]["success"]["count"] == 2 and cached["execution_count"] == 1


def test_statistics_of_unknown_models_are_not_found(clients, server):
    http, grpc = clients
    for name, version in [("nope", ""), ("simple", "9")]:
        with pytest.raises(InferenceServerException) as over_http:
            http.get_inference_statistics(name, version)
        assert over_http.value.status() == "404"
        with pytest.raises(InferenceServerException) as over_grpc:
            grpc.get_inference_statistics(name, version)
        assert over_grpc.value.status() == "StatusCode.NOT_FOUND"
    response = httpx.get(f"http://127.0.0.1:{server.http_port}/v2/models/nope/stats")
    assert response.json() == {"error": "Request for unknown model: 'nope' is not found"}


def test_metadata_and_config_announce_what_works(clients):
    http, grpc = clients
    assert "statistics" in http.get_server_metadata()["extensions"]
    assert "statistics" in grpc.get_server_metadata().extensions
    assert http.get_model_config("cached_square")["response_cache"] == {"enable": True}
    assert http.get_model_config("simple")["response_cache"] == {"enable": False}
    assert grpc.get_model_config("cached_square").config.response_cache.enable


def _scrape(port: int) -> tuple[str, dict]:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, s.labels.get("model"), s.labels.get("reason"))] = s.value
    return response.headers["content-type"], samples


def test_metrics_on_both_ports_agree_with_the_statistics(clients, server):
    http, _ = clients
    stats = _by_model(http.get_inference_statistics())
    assert server.metrics_addresses and server.metrics_port != server.http_port
    for port in (server.http_port, server.metrics_port):
        content_type, samples = _scrape(port)
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        for (name, _), stat in stats.items():
            infer = stat["inference_stats"]
            assert (
                samples[("nv_inference_request_success_total", name, None)]
                == infer["success"]["count"]
            )
            failures = sum(
                samples[("nv_inference_request_failure_total", name, r)]
                for r in ("REJECTED", "CANCELED", "BACKEND", "OTHER")
            )
            assert failures == infer["fail"]["count"]
            assert samples[("nv_inference_count_total", name, None)] == stat["inference_count"]
            assert samples[("nv_inference_exec_count_total", name, None)] == stat["execution_count"]
            for family, key in [("request", "success"), ("queue", "queue")]:
                assert (
                    samples[(f"nv_inference_{family}_duration_us_total", name, None)]
                    == infer[key]["ns"] / 1000
                )
            assert (
                samples[("trioserve_queue_duration_seconds_count", name, None)]
                == infer["queue"]["count"]
            )
            assert (
                samples[("trioserve_compute_duration_seconds_count", name, None)]
                == infer["compute_infer"]["count"]
            )
        assert samples[("nv_inference_request_failure_total", "fail", "BACKEND")] == 1
        assert samples[("nv_cache_num_hits_per_model_total", "cached_square", None)] == 1
        assert 0 <= samples[("nv_cpu_utilization", None, None)] <= 1


def test_metrics_can_be_turned_off():
    config = ServerConfig(
        models=reference_zoo(),
        http_port=0,
        grpc_port=None,
        metrics=MetricsConfig(enabled=False, port=0),
    )
    with server_in_thread(config) as server:
        assert server.registry is None and server.metrics_port is None
        response = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics")
        assert response.status_code == 404


async def test_a_model_that_wants_a_cache_the_server_lacks_runs_uncached(caplog):
    config = ServerConfig(models=[cached_square], http_port=None, grpc_port=None)
    async with trioserve.open_server(config) as server:
        stats = server.repository.get("cached_square").inference_statistics()
        assert not stats.response_cache
    assert "enables the response cache, but the server has none" in caplog.text


async def test_clients_that_leave_count_as_canceled(nursery):
    """A REST client disconnects and a gRPC client cancels, both while queued."""
    release = trio.Event()

    @trioserve.model(
        name="gated",
        inputs=[TensorSpec("X", "FP32", [1])],
        outputs=[TensorSpec("Y", "FP32", [1])],
    )
    async def gated(X):
        await release.wait()
        return {"Y": X}

    config = ServerConfig(models=[gated], http_port=0, grpc_port=0)
    server: Server = await nursery.start(trioserve.serve, config)
    runner = server.repository.get("gated")
    one = np.ones(1, dtype=np.float32)
    with trio.fail_after(20):
        async with trio.open_nursery() as clients:
            clients.start_soon(runner.infer, _direct_request(one))  # holds the one instance
            await runner.wait_until(lambda load: load.executing == 1)
            body = b'{"inputs":[{"name":"X","shape":[1],"datatype":"FP32","data":[2]}]}'
            stream = await trio.open_tcp_stream("127.0.0.1", server.http_port)
            await stream.send_all(
                b"POST /v2/models/gated/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await runner.wait_until(lambda load: load.queued == 1)
            await stream.aclose()  # the client goes away while its request waits
            await runner.wait_until(lambda load: load.queued == 0)
            grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
            x = grpcclient.InferInput("X", [1], "FP32")
            x.set_data_from_numpy(one)
            with pytest.raises(InferenceServerException, match="Deadline"):
                await trio.to_thread.run_sync(lambda: grpc.infer("gated", [x], client_timeout=0.5))
            await runner.wait_until(lambda load: load.queued == 0)
            grpc.close()
            release.set()
    stats = runner.inference_statistics()
    assert stats.failures[FailureReason.CANCELED] == 2 and stats.fail.count == 2
    assert stats.success.count == 1


def _direct_request(x: np.ndarray) -> trioserve.InferenceRequest:
    tensor = trioserve.InputTensor("X", datatype("FP32"), x.shape, x)
    return trioserve.InferenceRequest("gated", "", {"X": tensor})
