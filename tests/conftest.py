from __future__ import annotations

from collections.abc import Iterator

import pytest

from trioserve import Server, ServerConfig
from trioserve.models import reference_zoo
from trioserve.testing import server_in_thread

HTTP_SERVERS = ["stdlib", "hypercorn"]


@pytest.fixture(scope="module", params=HTTP_SERVERS)
def zoo_server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The reference zoo on a real server (both transports), once per HTTP server kind."""
    config = ServerConfig(
        models=reference_zoo(), http_port=0, grpc_port=0, http_server=request.param
    )
    with server_in_thread(config) as server:
        yield server


@pytest.fixture
def http_url(zoo_server: Server) -> str:
    return f"127.0.0.1:{zoo_server.http_port}"
