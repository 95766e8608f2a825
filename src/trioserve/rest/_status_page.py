"""The status page: ``GET /`` and ``GET /status`` answer a page that shows the models and
their live figures, ``GET /status.json`` the document it polls every second.

The page is one static HTML file with its script inline: no framework, no build step,
no request to anywhere but this server. Everything it shows comes from
``metrics._status.StatusReport``.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

import trio

from .._served import ModelRepository
from ..metrics import StatusReport
from ._app import Endpoint, Request, Response
from ._router import Router

_HTML = b"text/html; charset=utf-8"
# Figures are live: a cache between the page and the server would show stale ones.
_NO_STORE = ((b"cache-control", b"no-store"),)


def add_status_page(
    router: Router[Endpoint], repository: ModelRepository, server_metadata: dict[str, Any]
) -> None:
    page = files(__package__).joinpath("status_page.html").read_bytes()
    report = StatusReport(repository, server_metadata)

    async def html(request: Request) -> Response:
        return Response(200, page, _HTML, _NO_STORE, compressible=True)

    async def document(request: Request) -> Response:
        body = json.dumps(report.document(trio.current_time()), separators=(",", ":"))
        return Response(200, body.encode(), headers=_NO_STORE)

    router.add("GET", "/", html)
    router.add("GET", "/status", html)
    router.add("GET", "/status.json", document)
