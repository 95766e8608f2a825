"""The root of a server instance: one nursery that owns models and front ends.

    open_server(config)                 async context manager (the root nursery)
    ├── repository.run                  one task tree per model version
    ├── REST front end                  our HTTP/1.1 core, or Hypercorn
    ├── gRPC front end                  config.grpc_server: "builtin" or "grpclib" (grpclib
    │                                   through trio-asyncio), one method table
    └── metrics listener                GET /metrics on its own port, when configured

What the instance owns (its repository, shared-memory regions, load reporter, metrics
registry, inference pipeline) reaches every front end as one ``ServerContext``; REST
infer, both gRPC front ends and the in-process ``Server.infer`` run each request
through its ``InferencePipeline``.

``serve(config, task_status=...)`` follows trio's start protocol: it reports the running
``Server`` (with its bound ports) once every model is loaded and every port listens.
Graceful shutdown (``Server.shutdown``) stops the front ends accepting, lets requests in
flight finish for up to ``exit_timeout_s``, then cancels everything.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from prometheus_client import CollectorRegistry

from ._alternatives import check_alternatives, grpclib_server, hypercorn_server
from ._backend_config import onnxruntime_settings, python_settings
from ._config import ServerConfig
from ._context import ServerContext, server_context
from ._generative import GenerativeModel
from ._inprocess import InProcessFrontEnd
from ._model import Model
from ._served import ModelRepository, ServedModel
from ._types import InferenceResponse
from .grpc import serve_grpc_core
from .metrics import CountersCollector, LLMMetricFamilies
from .models import load_checkpoint_model
from .repository import PythonOptions, RepositoryManager, configure_onnxruntime
from .rest import HTTP_COUNTERS, HttpStatistics, RestApp, build_app, serve_http11, serve_metrics
from .scheduler import GenerativeRunner, RequestIds, ResponseCache, runner_class
from .shm import SharedMemoryRegistry

logger = logging.getLogger("trioserve")

Address = tuple[str, int]


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
    shared_memory: SharedMemoryRegistry
    rest_app: RestApp  # the REST front end's ASGI app, listening or not
    _in_process: InProcessFrontEnd
    _context: ServerContext  # what front ends serve (``testing.open_grpc_channel``)
    registry: CollectorRegistry | None = None  # the server's Prometheus metrics
    metrics_addresses: list[Address] = field(default_factory=list)  # the metrics port's
    # What its front ends share; front-end worker processes serve calls through it.
    context: ServerContext | None = None

    @property
    def http_port(self) -> int | None:
        return self.http_addresses[0][1] if self.http_addresses else None

    @property
    def grpc_port(self) -> int | None:
        return self.grpc_addresses[0][1] if self.grpc_addresses else None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_addresses[0][1] if self.metrics_addresses else None

    async def shutdown(self) -> None:
        """Stop accepting, drain requests in flight (bounded by exit_timeout_s), then stop."""
        self._stop_accepting.set()
        with trio.move_on_after(self.config.exit_timeout_s):
            await self._front_ends_done.wait()
        self._services.cancel()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
        outputs: Sequence[str] | None = None,
        request_id: str = "",
    ) -> InferenceResponse:
        """Infer in-process: ``inputs`` maps input names to numpy arrays (batch dimension
        included where the model batches). The request takes the front ends' path
        (validation, batching, statistics, metrics, load reports) without a socket."""
        return await self._in_process.infer(
            model,
            inputs,
            version=version,
            parameters=parameters,
            outputs=outputs,
            request_id=request_id,
        )

    def generate(
        self, model: str, prompt: str, *, version: str | int | None = None, **sampling: Any
    ) -> AsyncIterator[str]:
        """Generate in-process: the text pieces of ``prompt``'s continuation as the engine
        makes them; ``sampling`` takes the generate endpoint's keys (max_tokens...).
        To stop early, iterate inside ``contextlib.aclosing(...)``: closing the iterator
        aborts the request at once."""
        return self._in_process.generate(model, prompt, version=version, **sampling)


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


class StartupError(Exception):
    """The server cannot start: a model failed to load and ``exit_on_error`` is set."""


@asynccontextmanager
async def open_server(config: ServerConfig) -> AsyncIterator[Server]:
    """Run a server for the duration of the block; leaving it cancels everything."""
    check_alternatives(config)  # a front end that cannot serve here is refused first
    # In explicit mode, even the built-in models wait for a load.
    explicit = config.model_control_mode == "explicit"
    cache = ResponseCache(config.response_cache_bytes) if config.response_cache_bytes else None
    # One set of LLM families for the server's life: generative models loaded through
    # the repository API later join them.
    llm_metrics = LLMMetricFamilies(
        config.models, show_hidden_metrics_for_version=config.show_hidden_metrics_for_version
    )
    request_ids = RequestIds()  # the server's one source of engine request ids
    runners = partial(_served, config, cache, llm_metrics, request_ids)
    repository = ModelRepository([] if explicit else runners(config.models))
    context = server_context(config, repository, request_ids=request_ids)
    if context.registry is not None:  # empty until a generative model is served
        context.registry.register(llm_metrics)
    rest_app = build_app(context)
    front_ends = _FrontEnds()
    async with trio.open_nursery() as root:
        # The services get a nursery of their own, so that shutdown() stops them without
        # cancelling the caller's block, which runs in ``root``.
        services: trio.Nursery = await root.start(_hold_nursery)
        await services.start(context.tracing.run)  # writes trace files; flushes at the end
        await services.start(repository.run)
        configure_onnxruntime(onnxruntime_settings(config.backend_config))
        manager = RepositoryManager(
            repository,
            runners,
            folders=config.model_repositories,
            builtin=config.models,
            mode=config.model_control_mode,
            startup_models=config.load_models,
            poll_secs=config.repository_poll_s,
            strict=config.strict_model_config,
            registry=context.registry,
            checkpoint_loader=load_checkpoint_model,
            load_threads=config.model_load_thread_count,
            load_timeout_s=config.model_load_timeout_s,
            python=PythonOptions(
                config.python_instance_mode, python_settings(config.backend_config)
            ),
        )
        repository.strict_readiness = config.strict_readiness
        await services.start(manager.run)
        if config.exit_on_error and manager.failed_models():
            raise StartupError("failed to load all models")
        http: list[Address] = []
        grpc: list[Address] = []
        metrics: list[Address] = []
        if config.http_port is not None:
            rest = _rest_front_end(rest_app, context, config.http_port)
            http = await services.start(front_ends.run, rest)
        else:  # the app still serves in-process clients (``Server.rest_app``)
            services.start_soon(rest_app.run_background)
        if config.grpc_port is not None:
            grpc = await services.start(front_ends.run, _grpc_front_end(context))
        if context.registry is not None and config.metrics.port is not None:
            listener = _metrics_listener(context, context.registry, config.metrics.port)
            metrics = await services.start(front_ends.run, listener)
        if front_ends.running == 0:
            front_ends.done.set()
        server = Server(
            config=config,
            repository=repository,
            http_addresses=http,
            grpc_addresses=grpc,
            _stop_accepting=context.stop_accepting,
            _front_ends_done=front_ends.done,
            _services=services.cancel_scope,
            _stopped=trio.Event(),
            shared_memory=context.shared_memory,
            rest_app=rest_app,
            _in_process=InProcessFrontEnd(context),
            _context=context,
            registry=context.registry,
            metrics_addresses=metrics,
            context=context,
        )
        try:
            yield server
        finally:
            root.cancel_scope.cancel()
            # Requests still in flight keep their regions open until they end.
            context.shared_memory.close()
            context.logs.close()


def _served(
    config: ServerConfig,
    cache: ResponseCache | None,
    llm_metrics: LLMMetricFamilies,
    request_ids: RequestIds,
    models: Sequence[Model],
) -> list[ServedModel]:
    """What serves each model version: the continuous-batching engine for generative
    models, a runner otherwise. Runners that opt in share the server's response cache."""
    bounds = config.metrics.histogram_bounds_ns()
    served: list[ServedModel] = []
    for model in models:
        for version in model.versions:
            if isinstance(model, GenerativeModel):
                telemetry = llm_metrics.telemetry(model, version)
                engine = GenerativeRunner(
                    model, version, telemetry, histogram_bounds_ns=bounds, request_ids=request_ids
                )
                served.append(engine)
            else:
                cached = _cache_for(model, cache)
                runner = runner_class(model)
                served.append(runner(model, version, cache=cached, histogram_bounds_ns=bounds))
    return served


def _cache_for(model: Model, cache: ResponseCache | None) -> ResponseCache | None:
    if model.response_cache and cache is None:
        logger.warning(
            "model %r enables the response cache, but the server has none "
            "(--cache-config local,size=BYTES): serving it uncached",
            model.name,
        )
    return cache if model.response_cache else None


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


def _rest_front_end(
    app: RestApp, context: ServerContext, port: int
) -> Callable[..., Awaitable[None]]:
    config = context.config
    serve_http: Callable[..., Awaitable[None]]
    if config.http_server == "hypercorn":
        serve_http = partial(
            hypercorn_server(), certfile=config.http_tls_certfile, keyfile=config.http_tls_keyfile
        )
    else:
        statistics = HttpStatistics()
        if context.registry is not None:
            context.registry.register(
                CountersCollector("trioserve_http_", statistics, HTTP_COUNTERS)
            )
        serve_http = partial(serve_http11, statistics=statistics)
    bound = partial(
        serve_http, app, config.host, port, config.http_limits,
        shutdown_trigger=context.stop_accepting.wait,
    )  # fmt: skip
    return partial(app.serve_with, bound)


def _grpc_front_end(context: ServerContext) -> Callable[..., Awaitable[None]]:
    """The gRPC front end ``config.grpc_server`` names."""
    if context.config.grpc_server == "grpclib":
        return partial(grpclib_server(), context)

    return partial(serve_grpc_core, context)


def _metrics_listener(
    context: ServerContext, registry: CollectorRegistry, port: int
) -> Callable[..., Awaitable[None]]:

    config = context.config
    return partial(
        serve_metrics,
        registry,
        config.host,
        port,
        config.http_limits,
        shutdown_trigger=context.stop_accepting.wait,
        sources=context.metrics_sources,
    )
