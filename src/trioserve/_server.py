"""The root of a server instance: one nursery that owns models and front ends.

    open_server(config)                 async context manager (the root nursery)
    ├── repository.run                  one task tree per model version
    ├── REST front end                  our HTTP/1.1 core, or Hypercorn
    └── gRPC front end                  grpclib through trio-asyncio

``serve(config, task_status=...)`` follows trio's start protocol: it reports the running
``Server`` (with its bound ports) once every model is loaded and every port listens.
Graceful shutdown (``Server.shutdown``) stops the front ends accepting, lets requests in
flight finish for up to ``exit_timeout_s``, then cancels everything.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from ._config import ServerConfig
from ._generative import GenerativeModel
from ._model import Model
from ._repository import ModelRepository, ServedModel
from ._version import __version__
from .metrics._llm_telemetry import LLMMetricFamilies
from .scheduler._generative_runner import GenerativeRunner
from .scheduler._runner import ModelRunner

Address = tuple[str, int]

# What works today, by Triton's extension names; listed in server metadata.
EXTENSIONS = ("binary_tensor_data", "model_configuration", "parameters", "schedule_policy")


def server_metadata() -> dict[str, Any]:
    return {"name": "trioserve", "version": __version__, "extensions": list(EXTENSIONS)}


@dataclass
class Server:
    """A running server instance."""

    config: ServerConfig
    repository: ModelRepository
    http_addresses: list[Address]
    grpc_addresses: list[Address]
    _stop_accepting: trio.Event
    _front_ends_done: trio.Event
    _services: trio.CancelScope
    _stopped: trio.Event

    @property
    def http_port(self) -> int | None:
        return self.http_addresses[0][1] if self.http_addresses else None

    @property
    def grpc_port(self) -> int | None:
        return self.grpc_addresses[0][1] if self.grpc_addresses else None

    async def shutdown(self) -> None:
        """Stop accepting, drain requests in flight (bounded by exit_timeout_s), then stop."""
        self._stop_accepting.set()
        with trio.move_on_after(self.config.exit_timeout_s):
            await self._front_ends_done.wait()
        self._services.cancel()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


class _FrontEnds:
    """Starts front ends and tells when all of them have returned after draining."""

    def __init__(self) -> None:
        self.running = 0
        self.done = trio.Event()

    async def run(
        self,
        serve: Callable[..., Awaitable[None]],
        *,
        task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self.running += 1
        try:
            await serve(task_status=task_status)
        finally:
            self.running -= 1
            if self.running == 0:
                self.done.set()


@asynccontextmanager
async def open_server(config: ServerConfig) -> AsyncIterator[Server]:
    """Run a server for the duration of the block; leaving it cancels everything."""
    llm_metrics = LLMMetricFamilies(
        config.models, show_hidden_metrics_for_version=config.show_hidden_metrics_for_version
    )
    repository = ModelRepository(
        _served(model, version, llm_metrics)
        for model in config.models
        for version in model.versions
    )
    stop_accepting = trio.Event()
    front_ends = _FrontEnds()
    async with trio.open_nursery() as root:
        # The services get a nursery of their own, so that shutdown() stops them without
        # cancelling the caller's block, which runs in ``root``.
        services: trio.Nursery = await root.start(_hold_nursery)
        await services.start(repository.run)
        http: list[Address] = []
        grpc: list[Address] = []
        if config.http_port is not None:
            rest = _rest(config, config.http_port, repository, stop_accepting)
            http = await services.start(front_ends.run, rest)
        if config.grpc_port is not None:
            grpc_front_end = _grpc(config, config.grpc_port, repository, stop_accepting)
            grpc = await services.start(front_ends.run, grpc_front_end)
        if front_ends.running == 0:
            front_ends.done.set()
        server = Server(
            config, repository, http, grpc, stop_accepting, front_ends.done,
            services.cancel_scope, trio.Event(),
        )
        try:
            yield server
        finally:
            root.cancel_scope.cancel()


def _served(model: Model, version: str, llm_metrics: LLMMetricFamilies) -> ServedModel:
    if isinstance(model, GenerativeModel):
        return GenerativeRunner(model, version, llm_metrics.telemetry(model, version))
    return ModelRunner(model, version)


async def _hold_nursery(*, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    async with trio.open_nursery() as nursery:
        task_status.started(nursery)
        await trio.sleep_forever()


async def serve(
    config: ServerConfig, *, task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled or until ``Server.shutdown`` completes."""
    async with open_server(config) as server:
        task_status.started(server)
        await server.wait_stopped()


def _rest(
    config: ServerConfig, port: int, repository: ModelRepository, stop: trio.Event
) -> Callable[..., Awaitable[None]]:
    from .rest._endpoints import build_app

    app = build_app(repository, server_metadata(), config.http_limits.max_body_bytes)
    if config.http_server == "hypercorn":
        from .rest._hypercorn import serve_hypercorn  # imported only when chosen

        return partial(app.serve_with, partial(
            serve_hypercorn, app, config.host, port, config.http_limits,
            certfile=config.tls_certfile, keyfile=config.tls_keyfile, shutdown_trigger=stop.wait,
        ))
    from .rest._http11 import serve_http11

    return partial(app.serve_with, partial(
        serve_http11, app, config.host, port, config.http_limits, shutdown_trigger=stop.wait,
    ))


def _grpc(
    config: ServerConfig, port: int, repository: ModelRepository, stop: trio.Event
) -> Callable[..., Awaitable[None]]:
    from .grpc import serve_grpc

    return partial(
        serve_grpc, repository, server_metadata(), config.host, port,
        max_message_bytes=config.grpc_max_message_bytes, shutdown_trigger=stop.wait,
    )
