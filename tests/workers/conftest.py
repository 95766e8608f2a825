"""The workers' tests' shared fixture: ``worker``, the worker's end of a link that the
core of the module's ``server`` fixture serves in process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from trioserve._server import Server
from trioserve.ipc import TrioChannel, channel_pair
from trioserve.workers._core_link import WorkerLink

from ._link_worker import Worker


@pytest.fixture
async def worker(server: Server, nursery: trio.Nursery) -> AsyncIterator[Worker]:
    core_end, worker_end = channel_pair()
    assert server.context is not None
    link = WorkerLink(TrioChannel(core_end), server.context, server.rest_app, {})
    nursery.start_soon(link.serve, [])
    worker = Worker(worker_end)
    try:
        yield worker
    finally:
        worker.channel.close()
        for arena in worker.arenas:
            arena.close()
