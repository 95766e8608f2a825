"""``trioserve run``: command-line flags -> ``ServerConfig`` -> ``trio.run``.

Flags follow tritonserver's names where one exists (``--model-repository``,
``--http-port``, ``--grpc-port``, ``--exit-timeout-secs``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

import trio

from . import _gc, _scheduling
from ._alternatives import check_alternatives
from ._backend_config import parse_backend_setting
from ._config import PYTHON_INSTANCE_MODES, ServerConfig
from ._limits import GrpcLimits, HttpLimits
from ._log_settings import FORMATS, LogConfig
from ._metrics_config import metrics_config_from_flags
from ._model import Model
from ._restricted import parse_restrictions
from ._server import Address, Server, StartupError, open_server
from ._version import __version__
from .grpc import grpc_methods
from .repository import RepositoryError
from .scheduler import cache_size_from_flags
from .tracing import trace_config_from_flags
from .workers import WorkerPool, WorkerStartError

logger = logging.getLogger("trioserve")

DEFAULT_WORKERS = 0  # see README, "Front-end workers"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trioserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"trioserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="serve a model repository (or the built-in models)")
    run.add_argument(
        "--model-repository",
        type=Path,
        action="append",
        default=[],
        help="a Triton model repository (repeatable); without one, the built-in examples",
    )
    run.add_argument("--model-control-mode", choices=("none", "poll", "explicit"), default="none")
    run.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="explicit mode: load NAME at startup (repeatable; '*' loads every model)",
    )
    run.add_argument("--repository-poll-secs", type=float, default=15.0)
    run.add_argument(
        "--model-load-thread-count",
        type=int,
        default=4,
        metavar="N",
        help="models that load at once (default 4, as Triton)",
    )
    run.add_argument(
        "--model-load-timeout-secs",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a load whose import or initialize runs longer fails (default 600; 0: no "
        "limit); its thread cannot be stopped and is left to finish",
    )
    run.add_argument(
        "--exit-on-error",
        type=_boolean,
        default=True,
        metavar="BOOL",
        help="a model that fails to load at startup stops the server (default true)",
    )
    run.add_argument(
        "--strict-readiness",
        type=_boolean,
        default=True,
        metavar="BOOL",
        help="not ready while a model that should serve failed to load or loads "
        "(default true); false: ready once the server is up",
    )
    run.add_argument(
        "--python-instance-mode",
        choices=PYTHON_INSTANCE_MODES,
        default="process",
        help="where Python-backend model instances run: 'process', each in a process of "
        "its own, as Triton runs them (the default); 'thread', in worker threads of the "
        "server. A model's config.pbtxt parameter TRIOSERVE_INSTANCE_MODE overrides it",
    )
    run.add_argument(
        "--strict-model-config",
        type=_boolean,
        default=False,
        metavar="BOOL",
        help="no auto-complete: every model needs a complete config.pbtxt",
    )
    run.add_argument(
        "--backend-config",
        action="append",
        default=[],
        metavar="BACKEND,KEY=VALUE",
        help="a backend's server-wide setting (repeatable), as Triton's: "
        "onnxruntime,enable-global-threadpool=1 shares one thread pool among all ONNX "
        "Runtime sessions; onnxruntime,intra_op_thread_count=N / inter_op_thread_count=N "
        "size it; onnxruntime,default-max-batch-size=N (4) is auto-complete's batch size",
    )
    run.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also serve a Hugging Face Llama-family checkpoint folder as generative model NAME "
        "(repeatable; without --model-repository, only the checkpoints are served)",
    )
    run.add_argument(
        "--checkpoint-device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="where the --checkpoint models run: gpu on a CUDA device through cupy (the extra "
        "trioserve[gpu]; without cupy or a device, the CPU serves them)",
    )
    run.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    run.add_argument("--http-port", type=int, default=8000)
    run.add_argument("--grpc-port", type=int, default=8001)
    run.add_argument("--allow-http", type=_boolean, default=True, metavar="BOOL")
    run.add_argument("--allow-grpc", type=_boolean, default=True, metavar="BOOL")
    run.add_argument(
        "--http-server",
        type=_old_name("stdlib"),
        choices=("builtin", "hypercorn"),
        default="builtin",
        help="builtin (or its old name stdlib): the built-in HTTP/1.1 server (fastest); "
        "hypercorn: HTTP/2, h2c and TLS (the extra trioserve[hypercorn])",
    )
    run.add_argument(
        "--grpc-server",
        type=_old_name("trio"),
        choices=("builtin", "grpclib"),
        default="builtin",
        help="builtin (or its old name trio): the built-in HTTP/2 server; grpclib: grpclib "
        "through trio-asyncio (the extra trioserve[grpclib])",
    )
    run.add_argument(
        "--http-tls-certfile",
        "--tls-certfile",
        help="with --http-server hypercorn: serve HTTPS (--tls-certfile: its old name)",
    )
    run.add_argument("--http-tls-keyfile", "--tls-keyfile", help="(--tls-keyfile: its old name)")
    defaults = HttpLimits()
    run.add_argument("--http-max-body-bytes", type=int, default=defaults.max_body_bytes)
    run.add_argument("--http-max-header-bytes", type=int, default=defaults.max_header_bytes)
    run.add_argument("--http-max-header-count", type=int, default=defaults.max_header_count)
    run.add_argument("--http-idle-timeout-secs", type=float, default=defaults.idle_timeout_s)
    run.add_argument(
        "--http-max-request-line-bytes",
        type=int,
        default=defaults.max_request_line_bytes,
        help="a longer request line is answered 414",
    )
    run.add_argument(
        "--http-header-timeout-secs",
        type=float,
        default=defaults.header_timeout_s,
        help="time to receive a request head once its first byte came (built-in server); 408",
    )
    run.add_argument(
        "--http-max-connections",
        type=int,
        default=defaults.max_connections,
        help="HTTP connections open at once; one more is answered 503",
    )
    run.add_argument(
        "--http-body-timeout-secs",
        type=float,
        default=defaults.body_timeout_s,
        help="time to receive a whole request body (built-in HTTP server); then 408",
    )
    run.add_argument("--grpc-tls-certfile", help="serve gRPC over TLS (ALPN h2)")
    run.add_argument("--grpc-tls-keyfile")
    grpc_defaults = GrpcLimits()
    run.add_argument("--grpc-max-message-bytes", type=int, default=grpc_defaults.max_message_bytes)
    run.add_argument(
        "--grpc-max-concurrent-streams",
        type=int,
        default=grpc_defaults.max_concurrent_streams,
        help="calls open at once per gRPC connection",
    )
    run.add_argument(
        "--grpc-idle-timeout-secs",
        type=float,
        default=grpc_defaults.idle_timeout_s,
        help="close gRPC connections with no call open for this long",
    )
    run.add_argument(
        "--grpc-max-connections",
        type=int,
        default=grpc_defaults.max_connections,
        help="gRPC connections open at once (built-in gRPC server); one more is closed",
    )
    for flag, field, kind, text in _GRPC_HARDENING:
        run.add_argument(
            flag, dest=field, type=kind, default=getattr(grpc_defaults, field), help=text
        )
    run.add_argument("--exit-timeout-secs", type=float, default=30.0)
    run.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        metavar="N",
        help="front-end worker processes serving the HTTP, gRPC and metrics ports over one "
        f"core process that holds the models (default {DEFAULT_WORKERS}; 0: one process "
        "serves everything)",
    )
    run.add_argument(
        "--worker-arena-max-bytes",
        type=int,
        default=ServerConfig.worker_arena_max_bytes,
        help="with --workers: each worker's shared memory for the large bodies and tensors "
        "of its requests in flight; past it a request is refused (503, UNAVAILABLE)",
    )
    run.add_argument(
        "--ports-file",
        type=Path,
        help="once serving, write the bound ports here as JSON "
        '({"http": N, "grpc": N, "metrics": N}; null where off)',
    )
    run.add_argument(
        "--max-shared-memory-regions",
        type=int,
        default=ServerConfig.max_shared_memory_regions,
        help="shared-memory regions registered at once (each holds file descriptors)",
    )
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        run.add_argument(
            flag,
            action="append",
            default=[],
            metavar="API[,API]:KEY=VALUE",
            help="answer API (shared-memory, model-repository, trace, logging) only to requests "
            "with header KEY=VALUE",
        )
    run.add_argument(
        "--show-hidden-metrics-for-version",
        metavar="VERSION",
        help="also export the deprecated vLLM metrics that this (vLLM) release deprecated, "
        "e.g. 0.9",
    )
    run.add_argument("--allow-metrics", type=_boolean, default=True, metavar="BOOL")
    run.add_argument(
        "--metrics-port", type=int, help="also serve GET /metrics on this port (Triton: 8002)"
    )
    run.add_argument(
        "--metrics-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="histogram_latencies=true|false, histogram_buckets=S,S,... (seconds)",
    )
    run.add_argument(
        "--cache-config",
        action="append",
        default=[],
        metavar="local,size=BYTES",
        help="the response cache, for models that enable it (as in Triton)",
    )
    run.add_argument(
        "--allow-status-page",
        type=_boolean,
        default=True,
        metavar="BOOL",
        help="serve the live status page at / and /status on the HTTP port (default true)",
    )
    run.add_argument(
        "--trace-config",
        action="append",
        default=[],
        metavar="[MODE,]SETTING=VALUE",
        help="tracing, as tritonserver's: level=TIMESTAMPS, rate=N, count=N, "
        "mode=triton|opentelemetry, triton,file=PATH, triton,log-frequency=N, "
        "opentelemetry,url=URL, opentelemetry,resource=KEY=VALUE, "
        "opentelemetry,bsp_max_queue_size=N (bsp_schedule_delay=MS, bsp_max_export_batch_size=N)",
    )
    run.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    run.add_argument("--log-verbose", type=int, metavar="N", help="verbose level (0: none)")
    run.add_argument("--log-info", type=_boolean, metavar="BOOL")
    run.add_argument("--log-warning", type=_boolean, metavar="BOOL")
    run.add_argument("--log-error", type=_boolean, metavar="BOOL")
    run.add_argument("--log-file", default="", help="append the log here (default: stderr)")
    run.add_argument("--log-format", choices=FORMATS, default="default")
    return parser


def _boolean(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _old_name(old: str) -> Callable[[str], str]:
    """A server flag's value, with ``old`` read as its new name, "builtin"."""

    def value(text: str) -> str:
        return "builtin" if text == old else text

    return value


def _backend_config(settings: list[str]) -> dict[str, dict[str, str]]:
    config: dict[str, dict[str, str]] = {}
    for text in settings:
        backend, key, value = parse_backend_setting(text)
        config.setdefault(backend, {})[key] = value
    return config


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    repositories = list(args.model_repository)
    models: list[Model] = []
    if not repositories and not args.checkpoint:
        from .models import TRITON_EXAMPLES, builtin_models

        models = builtin_models()
        repositories = [TRITON_EXAMPLES]
    models += _checkpoint_models(args.checkpoint, args.checkpoint_device)
    return ServerConfig(
        models=models,
        model_repositories=repositories,
        model_control_mode=args.model_control_mode,
        load_models=args.load_model,
        repository_poll_s=args.repository_poll_secs,
        strict_model_config=args.strict_model_config,
        model_load_thread_count=args.model_load_thread_count,
        model_load_timeout_s=args.model_load_timeout_secs,
        backend_config=_backend_config(args.backend_config),
        exit_on_error=args.exit_on_error,
        strict_readiness=args.strict_readiness,
        python_instance_mode=args.python_instance_mode,
        host=args.host,
        http_port=args.http_port if args.allow_http else None,
        grpc_port=args.grpc_port if args.allow_grpc else None,
        http_server=args.http_server,
        grpc_server=args.grpc_server,
        http_tls_certfile=args.http_tls_certfile,
        http_tls_keyfile=args.http_tls_keyfile,
        grpc_tls_certfile=args.grpc_tls_certfile,
        grpc_tls_keyfile=args.grpc_tls_keyfile,
        grpc_limits=GrpcLimits(
            max_message_bytes=args.grpc_max_message_bytes,
            max_concurrent_streams=args.grpc_max_concurrent_streams,
            idle_timeout_s=args.grpc_idle_timeout_secs,
            max_connections=args.grpc_max_connections,
            **{field: getattr(args, field) for _, field, _, _ in _GRPC_HARDENING},
        ),
        http_limits=HttpLimits(
            max_body_bytes=args.http_max_body_bytes,
            max_header_bytes=args.http_max_header_bytes,
            max_header_count=args.http_max_header_count,
            max_request_line_bytes=args.http_max_request_line_bytes,
            header_timeout_s=args.http_header_timeout_secs,
            idle_timeout_s=args.http_idle_timeout_secs,
            body_timeout_s=args.http_body_timeout_secs,
            max_connections=args.http_max_connections,
        ),
        exit_timeout_s=args.exit_timeout_secs,
        max_shared_memory_regions=args.max_shared_memory_regions,
        worker_arena_max_bytes=args.worker_arena_max_bytes,
        http_restricted_apis=parse_restrictions(args.http_restricted_api),
        grpc_restricted_apis=parse_restrictions(args.grpc_restricted_protocol),
        show_hidden_metrics_for_version=args.show_hidden_metrics_for_version,
        metrics=metrics_config_from_flags(
            allow=args.allow_metrics, port=args.metrics_port, options=args.metrics_config
        ),
        response_cache_bytes=cache_size_from_flags(args.cache_config),
        status_page=args.allow_status_page,
        trace=trace_config_from_flags(args.trace_config),
        log=log_config_from_args(args),
    )


# The built-in gRPC server's defences: flag, ``GrpcLimits`` field (its default), type, help.
_GRPC_HARDENING: list[tuple[str, str, type, str]] = [
    ("--grpc-idle-close-share", "idle_close_share", float,
     "past this share of --grpc-max-connections, a new connection closes the one idle longest"),
    ("--grpc-max-reset-burst", "max_reset_burst", int,
     "streams reset (by either side) or refused per connection in a burst; then GOAWAY"),
    ("--grpc-resets-per-sec", "resets_per_s", float, "how fast that burst refills"),
    ("--grpc-max-continuation-frames", "max_continuation_frames", int,
     "CONTINUATION frames per header block; more: GOAWAY"),
    ("--grpc-hpack-cache-bytes", "hpack_cache_bytes", int,
     "decoded header blocks a connection remembers, in bytes"),
    ("--grpc-max-outbox-bytes", "max_outbox_bytes", int,
     "bytes unread by a client past which its connection stops reading"),
    ("--grpc-max-pending-bytes", "max_pending_bytes", int,
     "requests queued or unanswered per connection past which it stops taking more"),
    ("--grpc-max-header-list-bytes", "max_header_list_bytes", int,
     "a call's metadata as HTTP/2 counts it (SETTINGS_MAX_HEADER_LIST_SIZE); larger: 431"),
    ("--grpc-max-frame-bytes", "max_frame_bytes", int,
     "the largest frame a client may send (SETTINGS_MAX_FRAME_SIZE, 16,384 to 16,777,215)"),
    ("--grpc-stream-window-bytes", "stream_window_bytes", int,
     "receive window per call (SETTINGS_INITIAL_WINDOW_SIZE): how much a client sends ahead"),
    ("--grpc-connection-window-bytes", "connection_window_bytes", int,
     "receive window of a connection across its calls (at least 65,535)"),
]  # fmt: skip


def log_config_from_args(args: argparse.Namespace) -> LogConfig:
    """The log flags: ``--log-level`` first, Triton's finer flags over it."""
    level = args.log_level
    config = LogConfig(
        file=args.log_file,
        info=level in ("debug", "info"),
        warning=level != "error",
        verbose_level=1 if level == "debug" else 0,
        format=args.log_format,
    )
    finer = {
        "info": args.log_info,
        "warning": args.log_warning,
        "error": args.log_error,
        "verbose_level": args.log_verbose,
    }
    return replace(config, **{k: v for k, v in finer.items() if v is not None})


def _checkpoint_models(flags: list[str], device: Literal["cpu", "gpu"]) -> list[Model]:
    from .models import load_checkpoint_model

    models: list[Model] = []
    for flag in flags:
        name, equals, path = flag.partition("=")
        if not (name and equals and path):
            raise ValueError(f"--checkpoint takes NAME=PATH, got {flag!r}")
        models.append(load_checkpoint_model(path, name, device=device))
    return models


async def run_until_signalled(
    config: ServerConfig, workers: int = 0, ports_file: Path | None = None
) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully. ``workers``: front-end
    worker processes serving the HTTP, gRPC and metrics ports (0: this process serves
    them)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        # With workers, this process (the core) listens on no port: they serve them all.
        core = config
        if workers:
            _scheduling.run_as_batch()  # before the models load: their processes inherit it
            unserved = replace(config.metrics, port=None)
            core = replace(config, http_port=None, grpc_port=None, metrics=unserved)
        async with open_server(core) as server, trio.open_nursery() as pool_nursery:
            http, grpc = server.http_addresses, server.grpc_addresses
            metrics = server.metrics_addresses
            pool = None
            if workers:
                pool = _worker_pool(server, config, workers)
                ports = await pool_nursery.start(pool.run)
                http, grpc, metrics = ports.http, ports.grpc, ports.metrics
            for kind, addresses in (("HTTP", http), ("gRPC", grpc), ("Metrics", metrics)):
                for host, port in addresses:
                    logger.info("%s service listening on %s:%d", kind, host, port)
            if ports_file is not None:
                _write_ports(ports_file, http, grpc, metrics)
            logger.info("serving models: %s", ", ".join(server.repository.names()))
            _gc.tune()
            async with trio.open_nursery() as collector:
                collector.start_soon(_gc.collect_periodically)
                async for signum in signals:
                    logger.info(
                        "received %s: draining (up to %.0f s); send it again to stop at once",
                        signal.Signals(signum).name,
                        config.exit_timeout_s,
                    )
                    break
                collector.cancel_scope.cancel()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_exit_on_another_signal, signals)
                if pool is not None:
                    await pool.drain()  # the core answers the workers' calls in flight
                await server.shutdown()
                nursery.cancel_scope.cancel()


def _check_workers(workers: int, config: ServerConfig) -> None:
    if workers < 0:
        raise ValueError("--workers must be >= 0")
    if workers and (config.http_server != "builtin" or config.grpc_server != "builtin"):
        raise ValueError("--workers runs the built-in HTTP and gRPC servers only")


def _worker_pool(server: Server, config: ServerConfig, workers: int) -> WorkerPool:
    context = server.context
    assert context is not None
    pool = WorkerPool(
        workers,
        config,
        context,
        server.rest_app,
        grpc_methods(context),
        logging.getLogger().level,
    )
    if context.registry is not None:
        for collector in pool.collectors():
            context.registry.register(collector)  # type: ignore[arg-type]
        context.metrics_sources.append(pool.refresh_counters)
    return pool


def _write_ports(
    path: Path, http: list[Address], grpc: list[Address], metrics: list[Address]
) -> None:
    ports = {
        kind: addresses[0][1] if addresses else None
        for kind, addresses in (("http", http), ("grpc", grpc), ("metrics", metrics))
    }
    partial_path = path.with_name(path.name + ".partial")
    partial_path.write_text(json.dumps(ports))
    partial_path.replace(path)  # readers never see half a file


async def _exit_on_another_signal(signals: AsyncIterator[int]) -> None:
    """A second SIGINT or SIGTERM during the drain ends the process there and then.

    Nothing short of leaving the process is "at once": a model running in a worker thread
    cannot be cancelled, and the drain would wait for it. The exit status is 128 + the
    signal's number, what a shell reports for a process that signal ended, so it cannot be
    mistaken for a completed drain (0).
    """
    async for signum in signals:
        logger.warning("received %s again: stopping without draining", signal.Signals(signum).name)
        logging.shutdown()  # flush the log: _exit runs no handlers
        os._exit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
        check_alternatives(config)
        _check_workers(args.workers, config)
    except (RepositoryError, ValueError) as exc:
        sys.exit(f"trioserve: {exc}")
    # Model code sees the command line of a script started without arguments, as it
    # would run on its own: a model.py that parses its arguments at import (argparse)
    # must not read, and exit on, the server's flags.
    del sys.argv[1:]
    failure = None
    try:
        trio.run(run_until_signalled, config, args.workers, args.ports_file)
    except* WorkerStartError as group:
        failure = f"error: creating server: {group.exceptions[0]}"
    except* StartupError as group:
        # Triton's words, after the log has named each model that failed and why.
        failure = f"error: creating server: Internal - {group.exceptions[0]}"
    if failure is not None:
        # Outside the except* blocks: CPython before 3.11.4 (Debian 12's 3.11.2) wraps
        # what such a block raises in a group, and SystemExit would print as a traceback.
        sys.exit(failure)
