"""``GET /metrics``: the server's registry in the Prometheus text format.

Served on the HTTP port, and by a listener of its own when a metrics port is configured
(``metrics_app``), as Triton serves it on port 8002.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from ..metrics import CONTENT_TYPE, exposition
from ._app import Endpoint, Request, Response, RestApp
from ._router import Router


def metrics_endpoint(registry: CollectorRegistry) -> Endpoint:
    async def metrics(request: Request) -> Response:
        return Response(200, exposition(registry), CONTENT_TYPE, compressible=True)

    return metrics


def metrics_app(registry: CollectorRegistry, max_body_bytes: int) -> RestApp:
    """An app that answers ``GET /metrics`` and nothing else."""
    router: Router[Endpoint] = Router()
    router.add("GET", "/metrics", metrics_endpoint(registry))
    return RestApp(router, max_body_bytes)
