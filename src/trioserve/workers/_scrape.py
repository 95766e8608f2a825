"""``GET /metrics`` (on the HTTP port and the metrics port), written out in the worker:
the core collects the server's families (after every worker's counters, as in any
scrape) and sends them as they are; writing them out as text, most of a scrape's CPU,
is protocol work. A
client that polls ``/metrics`` often (a gateway reading the server's load) then costs the
core process, which every worker's requests wait on, a fraction of what it did.
"""

from __future__ import annotations

from ..metrics import CONTENT_TYPE, rendered
from ..rest import Request, Response
from ._client import WITHDRAWN, CoreClient
from ._forward import RestForwarder
from ._wire import SCRAPE


class MetricsScraper:
    """``GET /metrics``, on either port."""

    def __init__(self, client: CoreClient, generic: RestForwarder) -> None:
        self._client = client
        self._generic = generic

    async def rest(self, request: Request) -> Response | None:
        client = self._client
        pending = client.open_pending()
        await client.out.send((SCRAPE, pending.call))
        answer = await client.answer(pending, request)
        if answer is WITHDRAWN:
            return None  # the client left
        families = answer[1]
        if families is None:  # no metrics (404), or collecting failed (500): as one process
            await self._generic(request)
            return None
        return Response(200, rendered(families), CONTENT_TYPE, compressible=True)
