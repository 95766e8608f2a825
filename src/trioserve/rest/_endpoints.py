"""The Open Inference Protocol endpoints over REST: health, metadata, config, infer,
statistics (and ``/metrics`` when the server exports metrics)."""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

from .._context import ServerContext
from .._errors import InvalidArgumentError
from .._limits import OFF_LOOP_BYTES
from .._model_config import model_config, model_metadata
from .._served import Ticket
from .._stats import statistics_document
from .._types import InferenceRequest, InferenceResponse
from ._app import Endpoint, Request, Response, RestApp
from ._generate import GenerateEndpoints
from ._infer_codec import decode_request, encode_response
from ._json_body import COMPACT
from ._load_report import load_report_header
from ._metrics import metrics_endpoint
from ._openai import OpenAIEndpoints
from ._repository_endpoints import add_repository_routes
from ._router import Router
from ._shm_endpoints import add_shared_memory_routes
from ._status_page import add_status_page
from ._trace_endpoints import add_logging_routes, add_trace_routes

_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"

# Health: the status is the answer (200 true, 400 false: what Triton's clients read); a
# true one also carries KServe's body, which KServe's clients read instead.
_LIVE = Response(200, b'{"live":true}')
_READY = Response(200, b'{"ready":true}')
_FALSE = Response(400, content_type=None)

# Binary outputs smaller than this are joined to the JSON header: one buffer to send
# costs less than a list, and the copy is small.
_JOIN_BELOW = 64 * 1024


def _json(document: Any) -> Response:
    return Response(200, COMPACT.encode(document).encode())


class _RequestWatch:
    """A waiting ticket withdrawn when its HTTP client leaves (``_pipeline.Watch``): the
    twin of gRPC's ``_CallWatch``."""

    def track(self, ticket: Ticket, request: Request) -> Request:
        request.cancel_with(ticket.withdraw)
        return request

    def untrack(self, ticket: Ticket, request: Request) -> None:
        request.cancel_with(None)


_REQUEST_WATCH = _RequestWatch()


class _InferenceEndpoints:
    def __init__(self, context: ServerContext) -> None:
        self.repository = context.repository
        self.pipeline = context.pipeline
        self.load = context.load
        self.server_metadata = _json(context.metadata)

    async def live(self, request: Request) -> Response:
        return _LIVE

    async def ready(self, request: Request) -> Response:
        return _READY if self.repository.ready() else _FALSE

    async def model_ready(self, request: Request) -> Response:
        params = request.params
        name = params["model"]
        if not self.repository.model_ready(name, params.get("version", "")):
            return _FALSE
        return _json({"name": name, "ready": True})

    async def metadata(self, request: Request) -> Response:
        return self.server_metadata

    async def model_metadata(self, request: Request) -> Response:
        name = request.params["model"]
        runner = self.repository.get(name, request.params.get("version", ""))
        return _json(model_metadata(runner.model, self.repository.versions(name)))

    async def model_config(self, request: Request) -> Response:
        runner = self.repository.get(request.params["model"], request.params.get("version", ""))
        return _json(model_config(runner.model))

    async def statistics(self, request: Request) -> Response:
        params = request.params
        stats = self.repository.statistics(params.get("model", ""), params.get("version", ""))
        return _json(statistics_document(stats))

    async def infer(self, request: Request) -> Response | None:
        name = request.params["model"]
        version = request.params.get("version", "")
        served = self.repository.get(name, version)
        decode = partial(
            decode_request, request.body, header_length(request.headers), served.model, name,
            version,
        )  # fmt: skip
        large = len(request.body) >= OFF_LOOP_BYTES
        answered = await self.pipeline.infer(
            served, decode, _REQUEST_WATCH, request,
            endpoint="HTTP end point", large=large, headers=request.headers,
        )  # fmt: skip
        if answered is None:
            return None  # withdrawn because the client disconnected: nobody to answer
        inference, result = answered
        load_report = load_report_header(self.load, served, request.headers)
        return small_infer_response(inference, result, load_report) or await infer_response(
            inference, result, load_report
        )


def small_infer_response(
    inference: InferenceRequest, result: InferenceResponse, load_report: Header | None
) -> Response | None:
    """An inference's HTTP response (JSON, or binary outputs after the JSON header) if
    its outputs are small, as nearly all are: no coroutine for it; else None, and
    ``infer_response`` encodes it in a worker thread."""
    if sum([t.data.nbytes for t in result.outputs]) >= OFF_LOOP_BYTES:
        return None
    return _response(encode_response(result, inference), load_report)


async def infer_response(
    inference: InferenceRequest, result: InferenceResponse, load_report: Header | None
) -> Response:
    """An inference's HTTP response with large outputs (``small_infer_response`` gave
    none), encoded in a worker thread: no other client waits for it."""
    encoded = await trio.to_thread.run_sync(encode_response, result, inference)
    return _response(encoded, load_report)


def _response(
    encoded: tuple[bytes, list[bytes | memoryview]], load_report: Header | None
) -> Response:
    header, raw = encoded
    headers: tuple[Header, ...] = () if load_report is None else (load_report,)
    if not raw:
        return Response(200, header, headers=headers, compressible=True)
    headers += ((b"inference-header-content-length", str(len(header)).encode()),)
    if sum(map(len, raw)) < _JOIN_BELOW:
        return Response(
            200, b"".join([header, *raw]), b"application/octet-stream", headers,
            compressible=True,
        )  # fmt: skip
    return Response(
        200, header, b"application/octet-stream", headers, compressible=True, parts=tuple(raw)
    )


Header = tuple[bytes, bytes]


def header_length(headers: dict[bytes, bytes]) -> int | None:
    """The binary extension's JSON header length (Inference-Header-Content-Length)."""
    value = headers.get(b"inference-header-content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise InvalidArgumentError("Inference-Header-Content-Length must be a non-negative integer")
    return int(value)


def build_app(context: ServerContext) -> RestApp:
    """The REST app of the server that ``context`` describes."""
    endpoints = _InferenceEndpoints(context)
    generate = GenerateEndpoints(context)
    router: Router[Endpoint] = Router()
    router.add("GET", "/v2/health/live", endpoints.live)
    router.add("GET", "/v2/health/ready", endpoints.ready)
    router.add("GET", "/v2", endpoints.metadata)
    router.add("GET", "/v2/models/stats", endpoints.statistics)
    if context.registry is not None:
        router.add("GET", "/metrics", metrics_endpoint(context.registry, context.metrics_sources))
    for base in (_MODEL, _VERSION):
        router.add("GET", base, endpoints.model_metadata)
        router.add("GET", f"{base}/ready", endpoints.model_ready)
        router.add("GET", f"{base}/config", endpoints.model_config)
        router.add("GET", f"{base}/stats", endpoints.statistics)
        router.add("POST", f"{base}/infer", endpoints.infer)
        router.add("POST", f"{base}/generate", generate.generate)
        router.add("POST", f"{base}/generate_stream", generate.generate_stream)
    openai = OpenAIEndpoints(context)
    router.add("GET", "/v1/models", openai.models)
    router.add("GET", "/v1/models/{model}", openai.model)
    router.add("POST", "/v1/completions", openai.completions)
    router.add("POST", "/v1/chat/completions", openai.chat_completions)
    restrictions = context.config.http_restricted_apis
    add_shared_memory_routes(router, context.shared_memory, restrictions.get("shared-memory"))
    add_repository_routes(router, context.repository, restrictions.get("model-repository"))
    add_trace_routes(router, context.tracing, context.repository, restrictions.get("trace"))
    add_logging_routes(router, context.logs, restrictions.get("logging"))
    if context.config.status_page:
        add_status_page(router, context.repository, context.metadata)
    return RestApp(router, context.config.http_limits.max_body_bytes)
