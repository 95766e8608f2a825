"""Fixtures of the HTTP server tests: an app started on either server, and the raw
clients a test opened closed after it (for the modules that name ``close_clients``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from ._raw_http import SERVERS, Client, Serve, starter


@pytest.fixture
async def close_clients() -> AsyncIterator[None]:
    """The raw clients a test opened, closed after it (``pytestmark`` of its module)."""
    yield
    while Client.open_clients:
        await Client.open_clients.pop().aclose()


@pytest.fixture(params=sorted(SERVERS))
def serve(request: pytest.FixtureRequest, nursery: trio.Nursery) -> Serve:
    """Starts an app on one of the two servers, on 127.0.0.1 and a free port."""
    return starter(request.param, nursery)


@pytest.fixture
def serve11(nursery: trio.Nursery) -> Serve:
    """Starts an app on the built-in HTTP/1.1 server only."""
    return starter("http11", nursery)
