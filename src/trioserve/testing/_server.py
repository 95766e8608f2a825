"""A server for in-process tests, and snapshots of what its models did.

Under ``trio.testing.MockClock(autojump_threshold=0)`` (pytest-trio's ``autojump_clock``
fixture) time stands still while any task can run and jumps straight to the next
deadline once all wait, so a test's requests see exactly the delays the scheduler and
the models declare. That holds for in-process clients only: over a socket, the clock
would jump while the kernel moves bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from .._config import ServerConfig
from .._model import Model
from .._server import Server, open_server
from .._stats import ModelStatistics


@asynccontextmanager
async def open_test_server(models: Sequence[Model], **settings: Any) -> AsyncIterator[Server]:
    """Serve ``models`` with no listeners for the duration of the block.

    ``settings`` are other ``ServerConfig`` fields. Talk to the server through
    ``Server.infer``, ``Server.generate`` and ``Server.rest_app``; leaving the block
    stops it.

    Model loads have no time limit here unless ``model_load_timeout_s`` is given: the
    limit counts on trio's clock, and a repository model imports and initializes in a
    worker thread, which a jumping mock clock does not wait for.
    """
    settings.setdefault("model_load_timeout_s", 0)
    config = ServerConfig(models=models, http_port=None, grpc_port=None, **settings)
    async with open_server(config) as server:
        yield server


def model_statistics(
    server: Server, model: str, version: str | int | None = None
) -> ModelStatistics:
    """A snapshot of one model version's statistics (the latest version by default):
    what the statistics extension and the ``nv_inference_*`` metrics report."""
    name = "" if version is None else str(version)
    return server.repository.get(model, name).inference_statistics()


def batch_size_counts(
    server: Server, model: str, version: str | int | None = None
) -> dict[int, int]:
    """How many times the model executed each batch size (in batch elements)."""
    statistics = model_statistics(server, model, version)
    return {b.batch_size: b.compute_infer.count for b in statistics.batch_stats}
