"""What a server instance owns and every front end shares, as one value.

Front ends take a ``ServerContext`` whole (``build_app(context)``,
``serve_grpclib(context)``), so a server setting reaches them without new parameters,
and none can end up with a shared-memory registry or load reporter of its own: a region
registered over REST is the one gRPC reads, and both report the same load.
``server_context`` is the one place that builds them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from ._config import ServerConfig
from ._log_settings import LogControl
from ._pipeline import InferencePipeline
from ._served import ModelRepository
from ._version import __version__
from .metrics import LoadReporter, server_registry
from .scheduler import RequestIds
from .shm import SharedMemoryRegistry
from .tracing import TraceControl

# What works today, by Triton's extension names; listed in server metadata.
EXTENSIONS = (
    "binary_tensor_data", "model_configuration", "model_repository",
    "model_repository(unload_dependents)", "parameters", "schedule_policy", "sequence",
    "statistics", "system_shared_memory", "trace", "logging",
)  # fmt: skip


def server_metadata(cuda_shared_memory: bool = False) -> dict[str, Any]:
    """``cuda_shared_memory``: listed only where it can work (cupy and a device)."""
    extensions = [*EXTENSIONS, "cuda_shared_memory"] if cuda_shared_memory else list(EXTENSIONS)
    return {"name": "trioserve", "version": __version__, "extensions": extensions}


@dataclass(frozen=True, kw_only=True)
class ServerContext:
    """What a server instance owns and its front ends share."""

    config: ServerConfig
    repository: ModelRepository
    shared_memory: SharedMemoryRegistry
    load: LoadReporter  # every front end reports the same load
    metadata: dict[str, Any]  # the server metadata document
    registry: CollectorRegistry | None  # the server's Prometheus metrics; None: off
    pipeline: InferencePipeline  # over ``shared_memory`` and ``load``
    stop_accepting: trio.Event  # set: front ends refuse new work and drain
    tracing: TraceControl  # the trace extension's settings; ``pipeline`` samples with it
    logs: LogControl  # the logging extension's settings
    # Awaited before each scrape of ``registry``: sources that report their figures only
    # when asked (front-end worker processes, ``trioserve.workers``).
    metrics_sources: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


def server_context(
    config: ServerConfig,
    repository: ModelRepository,
    *,
    load: LoadReporter | None = None,
    request_ids: RequestIds | None = None,
) -> ServerContext:
    """A fresh context for a server of ``config`` serving ``repository``; ``load``: a
    reporter of the caller's (one with a host of its own), else a new one;
    ``request_ids``: the ids the repository's generative runners draw, else new ones."""
    shared_memory = SharedMemoryRegistry(config.max_shared_memory_regions)
    load = LoadReporter() if load is None else load
    metrics = config.metrics
    tracing = TraceControl(config.trace)
    return ServerContext(
        config=config,
        repository=repository,
        shared_memory=shared_memory,
        load=load,
        metadata=server_metadata(shared_memory.cuda_available),
        registry=server_registry(repository, metrics) if metrics.enabled else None,
        pipeline=InferencePipeline(
            shared_memory, load, tracing, RequestIds() if request_ids is None else request_ids
        ),
        stop_accepting=trio.Event(),
        tracing=tracing,
        logs=LogControl(config.log),
    )
