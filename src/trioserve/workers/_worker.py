"""A front-end worker process (``python -m trioserve.workers FD``): it serves the HTTP,
metrics and gRPC ports on the listening sockets the core hands it and forwards every
call to the core over the link on descriptor FD.

It starts by reading its ``WorkerSettings`` (CONFIG), listens, says READY and tunes its
cyclic garbage collector as the core does (``_gc``). A DRAIN
from the core, or SIGTERM, drains it like a single server: listeners close, calls in
flight are answered (within ``exit_timeout_s``), then it exits 0. SIGINT is left to the
core (a terminal's Ctrl-C reaches the whole process group; the core then drains every
worker). If the core goes away, the worker stops at once and says so (exit status 1).
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from dataclasses import asdict
from functools import partial

import trio

from .. import _gc
from ..grpc import CoreStatistics, UnaryMethod, serve_methods, tls_context, with_reflection
from ..ipc import LinkClosed, TrioChannel
from ..rest import Endpoint, HttpStatistics, ReceivesInto, RestApp, Router, serve_http11
from ._client import CoreClient
from ._coalesce import grouped
from ._fast_infer import InferForwarder
from ._forward import ForwardAll, Raw, RestForwarder, forwarding_methods
from ._scrape import MetricsScraper
from ._wire import CONFIG, READY, WorkerSettings

logger = logging.getLogger("trioserve.workers")

_MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"  # decoded here (the fast path)


class CoreGone(Exception):
    """The core process closed the link: the server is stopping (or died)."""


async def serve_worker(channel: TrioChannel) -> None:
    """Serve until drained; raises ``CoreGone`` if the core goes away first."""
    frames = await channel.receive()
    (kind, settings), fds = frames[0]
    assert kind == CONFIG, "the core sends CONFIG first"
    logging.getLogger().setLevel(settings.log_level)  # the core's --log-level
    listeners = [socket.socket(fileno=fd) for fd in fds]
    for listener in listeners:
        listener.setblocking(False)
    http_listeners = listeners[: settings.http_sockets]
    grpc_from = settings.http_sockets + settings.metrics_sockets
    metrics_listeners = listeners[settings.http_sockets : grpc_from]
    grpc_listeners = listeners[grpc_from:]
    http_statistics = HttpStatistics()
    grpc_statistics = CoreStatistics()

    async with trio.open_nursery() as nursery:
        client = CoreClient(
            channel,
            nursery,
            lambda: {
                "http": asdict(http_statistics),
                "grpc": asdict(grpc_statistics),
                "worker": {"forwarded": client.forwarded},
            },
            settings.arena_max_bytes,
        )
        nursery.start_soon(_watch_core, client, frames[1:])
        nursery.start_soon(_drain_on_sigterm, client)
        stop = trio.Event()
        generic = RestForwarder(client)
        infer = InferForwarder(client, generic)
        scrape = MetricsScraper(client, generic).rest
        router = ForwardAll(generic)
        for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            router.add("POST", f"{base}/infer", ReceivesInto(infer.rest, infer.body_buffer))
        router.add("GET", "/metrics", scrape)
        async with trio.open_nursery() as front_ends:
            serve_rest = partial(_serve_rest, front_ends, settings, stop)
            if http_listeners:
                await serve_rest(router, http_listeners, http_statistics)
            if metrics_listeners:  # GET /metrics alone, as one process's metrics port
                only_metrics: Router[Endpoint] = Router()
                only_metrics.add("GET", "/metrics", scrape)
                await serve_rest(only_metrics, metrics_listeners, None)
            if grpc_listeners:
                tls = None if settings.grpc_tls is None else tls_context(*settings.grpc_tls)
                methods = forwarding_methods(client, settings.grpc_paths)
                methods[_MODEL_INFER] = UnaryMethod(Raw, partial(infer.grpc, _MODEL_INFER))
                methods = with_reflection(methods)
                serve = partial(
                    serve_methods, methods, settings.host, 0, settings.grpc_limits,
                    max_message_bytes=settings.grpc_limits.max_message_bytes, tls=tls,
                    statistics=grpc_statistics, shutdown_trigger=stop.wait,
                    listeners=grpc_listeners,
                )  # fmt: skip
                await front_ends.start(serve)
            await client.out.send((READY,))
            # As in the core: what startup built is frozen out of every collection, and
            # requests' short-lived objects meet rare young collections (``_gc``).
            _gc.tune()
            nursery.start_soon(_gc.collect_periodically)
            await client.drain.wait()
            stop.set()  # listeners close; calls in flight finish
            front_ends.cancel_scope.deadline = trio.current_time() + settings.exit_timeout_s
        nursery.cancel_scope.cancel()


async def _serve_rest(
    front_ends: trio.Nursery,
    settings: WorkerSettings,
    stop: trio.Event,
    router: Router[Endpoint],
    listeners: list[socket.socket],
    statistics: HttpStatistics | None,
) -> None:
    """Serve ``router``'s REST app over HTTP/1.1 on ``listeners`` until ``stop``."""
    limits = settings.http_limits
    app = RestApp(router, limits.max_body_bytes)
    serve = partial(
        serve_http11, app, settings.host, 0, limits, shutdown_trigger=stop.wait,
        statistics=statistics, listeners=listeners,
    )  # fmt: skip
    await front_ends.start(app.serve_with, serve)


async def _watch_core(client: CoreClient, frames: list[tuple[object, list[int]]]) -> None:
    try:
        await client.run(frames)
    except LinkClosed:
        raise CoreGone from None


async def _drain_on_sigterm(client: CoreClient) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            client.drain.set()
            return


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = int(argv[0])
    link = socket.socket(fileno=fd)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s [worker]: %(message)s",
    )

    async def run() -> None:
        # Coalescing: the INFERs a turn of the event loop sends (one per request) go in
        # one write; sent one by one, a worker spent about a fifth more CPU per request
        # at 64 connections. Alike ones go as one INFERS (``_coalesce.py``).
        await serve_worker(TrioChannel(link, coalesce=True, merge=grouped))

    core_gone = False
    try:
        trio.run(run)
    except* CoreGone:
        core_gone = True
    if core_gone:  # exits outside except*, for CPython before 3.11.4 (see _cli.main)
        logger.error("the core process is gone: this worker stops")
        sys.exit(1)
