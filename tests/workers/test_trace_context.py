"""``trioserve run --workers 1`` in opentelemetry mode: a client's W3C ``traceparent``
reaches the core's tracing through the worker (REST and gRPC, the inference decoded
in the worker), so its spans continue the client's trace, as in one process; a
``tracestate`` without a ``traceparent`` is no context. The core flushes its spans as it
stops, so every span has arrived once the server is gone."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from ._served import Served

HTTP_PARENT = ("1af7651916cd43dd8448eb211c80319d", "c7ad6b7169203332")
GRPC_PARENT = ("5cf92f3577b34da6a3ce929d0e0e4738", "20f067aa0ba902b9")


class _Exports(http.server.BaseHTTPRequestHandler):
    """OTLP/HTTP: each POSTed export's body kept, for the test to decode."""

    bodies: ClassVar[list[bytes]] = []  # one receiver at a time (the fixture clears it)

    def do_POST(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        # No body: an empty ExportTraceServiceResponse (all its fields unset).
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def spans() -> Iterator[list[Any]]:
    """The spans of a server with workers that answered four inferences: two with a
    client's context (HTTP, gRPC), one with a ``tracestate`` alone, one with none."""
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exports)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    try:
        served = Served(
            "--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS",
            "--trace-config", "rate=1000",  # only the requests with a context are traced
            "--trace-config", f"opentelemetry,url={url}",
            "--trace-config", "opentelemetry,bsp_schedule_delay=60000",  # sent as it stops
            workers=1,
        )  # fmt: skip
        try:
            _infer(httpclient, served.url, {"traceparent": _header(HTTP_PARENT)})
            _infer(grpcclient, served.grpc_url, {"traceparent": _header(GRPC_PARENT)})
            _infer(httpclient, served.url, {"tracestate": "vendor=1"})
            _infer(grpcclient, served.grpc_url, {})
        finally:
            assert served.stop() == 0
        yield [
            span
            for body in _Exports.bodies
            for resource in ExportTraceServiceRequest.FromString(body).resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
    finally:
        _Exports.bodies.clear()
        receiver.shutdown()
        receiver.server_close()
        thread.join()


def _header(parent: tuple[str, str]) -> str:
    return f"00-{parent[0]}-{parent[1]}-01"


def _infer(module: Any, url: str, headers: dict[str, str]) -> None:
    client = module.InferenceServerClient(url)
    try:
        inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
        result = client.infer("simple", inputs, headers=headers)
        assert result.as_numpy("OUTPUT0")[0, 3] == 6
    finally:
        client.close()


def test_a_clients_trace_context_crosses_the_worker(spans: list[Any]) -> None:
    roots = [span for span in spans if span.name == "InferRequest"]
    # Only the two requests with a traceparent were traced (the rate traces no other).
    assert sorted((r.trace_id.hex(), r.parent_span_id.hex()) for r in roots) == sorted(
        [HTTP_PARENT, GRPC_PARENT]
    )
    for root in roots:
        [model] = [span for span in spans if span.parent_span_id == root.span_id]
        assert model.name == "simple"
