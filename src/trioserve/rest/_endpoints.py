"""The Open Inference Protocol endpoints over REST: health, metadata, config, infer,
statistics (and ``/metrics`` when the server exports metrics)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from .._errors import InvalidArgumentError
from .._model_config import model_config, model_metadata
from .._repository import ModelRepository
from .._restricted import Restriction
from .._stats import statistics_document
from ..metrics._orca import LoadReporter
from ..shm import RequestRegions, SharedMemoryRegistry
from ._app import Endpoint, Request, Response, RestApp
from ._disconnects import DisconnectWatch
from ._generate import GenerateEndpoints
from ._infer_codec import decode_request, encode_response
from ._metrics import metrics_endpoint
from ._router import Router
from ._shm_endpoints import add_shared_memory_routes
from ._status_page import add_status_page

_COMPACT = json.JSONEncoder(separators=(",", ":"))
_MODEL = "/v2/models/{model}"
_VERSION = "/v2/models/{model}/versions/{version}"

# Health answers carry no body: 200 for true, 400 for false (what Triton's clients read).
_TRUE = Response(200, content_type=None)
_FALSE = Response(400, content_type=None)


def _json(document: Any) -> Response:
    return Response(200, _COMPACT.encode(document).encode())


class _Endpoints:
    def __init__(
        self,
        repository: ModelRepository,
        server_metadata: dict[str, Any],
        disconnects: DisconnectWatch,
        shared_memory: SharedMemoryRegistry,
        load: LoadReporter,
    ) -> None:
        self.repository = repository
        self.shared_memory = shared_memory
        self.disconnects = disconnects
        self.load = load
        self.server_metadata = _json(server_metadata)

    async def live(self, request: Request) -> Response:
        return _TRUE

    async def ready(self, request: Request) -> Response:
        return _TRUE if self.repository.ready() else _FALSE

    async def model_ready(self, request: Request) -> Response:
        params = request.params
        ready = self.repository.model_ready(params["model"], params.get("version", ""))
        return _TRUE if ready else _FALSE

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
        runner = self.repository.get(name, version)
        # One coroutine from here to the wait: every frame in the chain of awaits is
        # suspended and resumed again when the outcome arrives.
        regions = RequestRegions(self.shared_memory, runner.model.device)
        try:
            inference = decode_request(
                request.body, _header_length(request.headers), runner.model, name, version,
                regions,
            )  # fmt: skip
            if regions.device_inputs:
                await regions.read_device_inputs()
            counted = self.load.counting(runner)  # on arrival: the model's load as found
            ticket = runner.submit(inference)
            entry = self.disconnects.track(ticket, request.receive)
            try:
                await ticket.wait()
            except trio.Cancelled:
                ticket.withdraw()
                raise
            finally:
                self.disconnects.untrack(ticket, entry)
            if ticket.withdrawn:
                return None  # withdrawn because the client disconnected: nobody to answer
            with counted:
                result = ticket.outcome()
                if regions.device_outputs:
                    await regions.write_device_outputs(result)
                else:
                    regions.write_outputs(result)
        finally:
            regions.close()
        body, header_length = encode_response(result, inference)
        load_report = self.load.http_header(runner, request.headers)
        headers = [] if load_report is None else [load_report]
        if header_length is None:
            return Response(200, body, headers=headers, compressible=True)
        headers.append((b"inference-header-content-length", str(header_length).encode()))
        return Response(200, body, b"application/octet-stream", headers, compressible=True)


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"inference-header-content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise InvalidArgumentError("Inference-Header-Content-Length must be a non-negative integer")
    return int(value)


def build_app(
    repository: ModelRepository,
    server_metadata: dict[str, Any],
    max_body_bytes: int,
    *,
    shared_memory: SharedMemoryRegistry | None = None,
    restrictions: Mapping[str, Restriction] | None = None,
    load: LoadReporter | None = None,
    metrics: CollectorRegistry | None = None,
    status_page: bool = False,
) -> RestApp:
    """The REST app. The server passes what it owns (its shared-memory regions, its load
    reporter); an app built without them gets its own."""
    disconnects = DisconnectWatch()
    shared_memory = shared_memory or SharedMemoryRegistry()
    restriction = (restrictions or {}).get("shared-memory")
    load = load or LoadReporter()
    e = _Endpoints(repository, server_metadata, disconnects, shared_memory, load)
    generate = GenerateEndpoints(repository, load)
    router: Router[Endpoint] = Router()
    router.add("GET", "/v2/health/live", e.live)
    router.add("GET", "/v2/health/ready", e.ready)
    router.add("GET", "/v2", e.metadata)
    router.add("GET", "/v2/models/stats", e.statistics)
    if metrics is not None:
        router.add("GET", "/metrics", metrics_endpoint(metrics))
    for base in (_MODEL, _VERSION):
        router.add("GET", base, e.model_metadata)
        router.add("GET", f"{base}/ready", e.model_ready)
        router.add("GET", f"{base}/config", e.model_config)
        router.add("GET", f"{base}/stats", e.statistics)
        router.add("POST", f"{base}/infer", e.infer)
        router.add("POST", f"{base}/generate", generate.generate)
        router.add("POST", f"{base}/generate_stream", generate.generate_stream)
    add_shared_memory_routes(router, shared_memory, restriction)
    if status_page:
        add_status_page(router, repository, server_metadata)
    return RestApp(router, max_body_bytes, background=[disconnects.run])
