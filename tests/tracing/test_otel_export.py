"""opentelemetry mode: spans exported over OTLP/HTTP to a receiver the test runs, the
client's W3C trace context continued over HTTP and gRPC, vLLM's ``llm_request`` span
for generations (generate and the OpenAI endpoint), resource attributes from the
settings. The server's shutdown flushes the batch span processor, so every span has
arrived once the server is gone: nothing to wait for."""

from __future__ import annotations

import http.server
import json
import queue
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from trioserve import ServerConfig
from trioserve.models import TinyLM, reference_zoo
from trioserve.testing import server_in_thread
from trioserve.tracing import TraceConfig

HTTP_PARENT = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
GRPC_PARENT = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
GENERATE_PARENT = ("5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8")


def traceparent(parent: tuple[str, str]) -> str:
    return f"00-{parent[0]}-{parent[1]}-01"


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: decodes every export it is sent."""

    def __init__(self) -> None:
        self.exports: list[ExportTraceServiceRequest] = []
        received = self.exports

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                assert self.path == "/v1/traces"
                assert self.headers["Content-Type"] == "application/x-protobuf"
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    def spans(self) -> list[Any]:
        return [
            span
            for export in self.exports
            for resource in export.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]

    def resources(self) -> list[dict[str, Any]]:
        return [
            attributes(resource.resource.attributes)
            for export in self.exports
            for resource in export.resource_spans
        ]


def attributes(values: Any) -> dict[str, Any]:
    found = {}
    for entry in values:
        kind = entry.value.WhichOneof("value")
        value = getattr(entry.value, kind)
        if kind == "array_value":
            value = [getattr(v, v.WhichOneof("value")) for v in value.values]
        found[entry.key] = value
    return found


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.close()


@pytest.fixture(scope="module")
def spans(receiver: Receiver) -> list[Any]:
    """Every span of a server that answered: an HTTP and a gRPC inference, each with a
    client's traceparent, an untraced-by-rate one, a generation and an OpenAI one."""
    config = ServerConfig(
        models=[*reference_zoo(), TinyLM(num_kv_blocks=64, max_model_len=64)],
        http_port=0,
        grpc_port=0,
        trace=TraceConfig(
            level=("TIMESTAMPS",),
            rate=2,  # every second request, and every request with a trace context
            mode="opentelemetry",
            url=receiver.url,
            resource={"service.name": "inference-test", "deployment": "ci"},
            bsp_schedule_delay_ms=60_000,  # exported when the server stops
        ),
    )
    with server_in_thread(config) as server:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        inputs = simple_inputs(httpclient)
        http.infer("simple", inputs, headers={"traceparent": traceparent(HTTP_PARENT)})
        http.infer("simple", inputs, request_id="first-by-rate")  # 1st since: not traced
        http.infer("simple", inputs, request_id="second-by-rate")  # 2nd: traced
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        grpc.infer(
            "simple", simple_inputs(grpcclient), headers={"traceparent": traceparent(GRPC_PARENT)}
        )
        base = f"http://127.0.0.1:{server.http_port}"
        headers = {"traceparent": traceparent(GENERATE_PARENT), "tracestate": "vendor=1"}
        body = {"text_input": "hello", "parameters": {"max_tokens": 4, "temperature": 0.5}}
        post(f"{base}/v2/models/tiny_lm/generate", body, headers)
        stream_generate(grpc)
        completion = {"model": "tiny_lm", "prompt": "hi", "max_tokens": 3, "top_p": 0.9}
        post(f"{base}/v1/completions", completion, headers)
        http.close()
        grpc.close()
    return receiver.spans()


def simple_inputs(client: Any) -> list[Any]:
    """The ``simple`` model's inputs, in ``client``'s module (HTTP or gRPC)."""
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = client.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def stream_generate(grpc: grpcclient.InferenceServerClient) -> None:
    """A generation over ModelStreamInfer, the client's context in the call's metadata."""
    replies: queue.Queue[Any] = queue.Queue()
    grpc.start_stream(
        callback=lambda result, error: replies.put(error or result),
        headers={"traceparent": traceparent(GENERATE_PARENT)},
    )
    prompt = grpcclient.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"hey"], dtype=object))
    grpc.async_stream_infer("tiny_lm", [prompt], parameters={"max_tokens": 2})
    while True:
        reply = replies.get(timeout=30)
        assert not isinstance(reply, Exception), reply
        if reply.get_response().parameters["triton_final_response"].bool_param:
            break
    grpc.stop_stream()


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def named(spans: list[Any], name: str) -> list[Any]:
    return [span for span in spans if span.name == name]


def test_resource_attributes_come_from_the_settings(spans: list[Any], receiver: Receiver) -> None:
    for resource in receiver.resources():
        assert resource["service.name"] == "inference-test"
        assert resource["deployment"] == "ci"


@pytest.mark.parametrize("parent", [HTTP_PARENT, GRPC_PARENT], ids=["http", "grpc"])
def test_a_clients_traceparent_is_continued(spans: list[Any], parent: tuple[str, str]) -> None:
    trace_id, span_id = (bytes.fromhex(p) for p in parent)
    [root] = [s for s in named(spans, "InferRequest") if s.trace_id == trace_id]
    assert root.parent_span_id == span_id
    [model] = [s for s in spans if s.parent_span_id == root.span_id]
    assert model.name == "simple"
    assert attributes(model.attributes)["triton.model_name"] == "simple"
    assert [e.name for e in model.events] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    [compute] = [s for s in spans if s.parent_span_id == model.span_id]
    assert compute.name == "compute"
    assert [e.name for e in compute.events] == [
        "COMPUTE_START",
        "COMPUTE_INPUT_END",
        "COMPUTE_OUTPUT_START",
        "COMPUTE_END",
    ]
    # Where the one slow request spent its time: queue, then compute, within the request.
    start, queued, end = (e.time_unix_nano for e in model.events)
    assert root.start_time_unix_nano <= start <= queued <= compute.start_time_unix_nano
    assert compute.end_time_unix_nano <= end <= root.end_time_unix_nano


def test_the_rate_picks_requests_without_a_context(spans: list[Any]) -> None:
    models = [attributes(s.attributes) for s in named(spans, "simple")]
    assert sorted(m["triton.request_id"] for m in models) == ["", "", "second-by-rate"]


def test_generations_are_vllms_llm_request_spans(spans: list[Any]) -> None:
    trace_id, span_id = (bytes.fromhex(p) for p in GENERATE_PARENT)
    generated, streamed, completed = sorted(
        named(spans, "llm_request"), key=lambda span: span.start_time_unix_nano
    )
    for span in (generated, streamed, completed):
        assert span.trace_id == trace_id
        assert span.parent_span_id == span_id
        assert span.kind == span.SPAN_KIND_SERVER
    generate = attributes(generated.attributes)
    assert generate["gen_ai.response.model"] == "tiny_lm"
    assert generate["gen_ai.request.id"].startswith("http-")
    assert generate["gen_ai.usage.prompt_tokens"] == len("hello")  # one token a byte
    assert generate["gen_ai.usage.completion_tokens"] <= 4
    assert generate["gen_ai.request.max_tokens"] == 4
    assert generate["gen_ai.request.temperature"] == 0.5
    assert generate["gen_ai.request.n"] == 1
    e2e = generate["gen_ai.latency.e2e"]
    assert 0 <= generate["gen_ai.latency.time_in_queue"] <= e2e
    assert 0 < generate["gen_ai.latency.time_to_first_token"] <= e2e
    duration = generated.end_time_unix_nano - generated.start_time_unix_nano
    # The same interval: start and end were each rounded to a nanosecond, so the two
    # differ by under 1 ns, plus the float error of e2e in nanoseconds.
    assert abs(duration - e2e * 1e9) < 1.01
    stream = attributes(streamed.attributes)
    assert stream["gen_ai.request.id"].startswith("grpc-")
    assert stream["gen_ai.usage.prompt_tokens"] == len("hey")
    completion = attributes(completed.attributes)
    assert completion["gen_ai.request.id"].startswith("openai-")
    assert completion["gen_ai.request.top_p"] == 0.9
    assert completion["gen_ai.request.max_tokens"] == 3
