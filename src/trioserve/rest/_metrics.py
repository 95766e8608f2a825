"""``GET /metrics``: the server's registry in the Prometheus text format.

Served on the HTTP port, and by a listener of its own when a metrics port is configured
(``serve_metrics``), as Triton serves it on port 8002.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import trio
from prometheus_client import CollectorRegistry

from .._limits import HttpLimits
from ..metrics import CONTENT_TYPE, exposition
from ._app import Endpoint, Request, Response, RestApp
from ._http11 import serve_http11
from ._router import Router

Sources = Sequence[Callable[[], Awaitable[None]]]


def metrics_endpoint(registry: CollectorRegistry, sources: Sources = ()) -> Endpoint:
    """``sources``: awaited before each scrape (figures reported only when asked)."""

    async def metrics(request: Request) -> Response:
        for refresh in sources:
            await refresh()
        return Response(200, exposition(registry), CONTENT_TYPE, compressible=True)

    return metrics


def metrics_app(registry: CollectorRegistry, max_body_bytes: int, sources: Sources = ()) -> RestApp:
    """An app that answers ``GET /metrics`` and nothing else."""
    router: Router[Endpoint] = Router()
    router.add("GET", "/metrics", metrics_endpoint(registry, sources))
    return RestApp(router, max_body_bytes)


async def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    limits: HttpLimits,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    sources: Sources = (),
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` alone on ``host:port`` (our HTTP/1.1 server), like
    ``serve_http11``: reports the bound addresses, drains when ``shutdown_trigger`` returns."""
    app = metrics_app(registry, limits.max_body_bytes, sources)
    serve = partial(serve_http11, app, host, port, limits, shutdown_trigger=shutdown_trigger)
    await app.serve_with(serve, task_status=task_status)
