"""The core process's front-end workers: it binds the client ports, starts the workers,
hands each its listening sockets, serves their calls (``WorkerLink``), restarts a
worker that dies, drains them all on shutdown, and sums their counters for ``/metrics``.

Listening: on Linux each worker gets sockets of its own bound to the same port with
``SO_REUSEPORT``, so the kernel spreads connections evenly; the core keeps every socket
open, so a worker that restarts finds the connections that arrived meanwhile waiting in
its backlog. Elsewhere every worker accepts from the same inherited sockets.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import trio
from prometheus_client.core import CounterMetricFamily

from .._admission import Address
from .._config import ServerConfig
from .._context import ServerContext
from .._limits import GrpcLimits, HttpLimits
from .._sockets import bind_tcp, bound_addresses, close_all
from ..grpc import GRPC_COUNTERS, Method, StreamMethod, with_reflection
from ..ipc import LinkClosed, TrioChannel, channel_pair
from ..metrics import CountersCollector
from ..rest import HTTP_COUNTERS, RestApp
from ._core_link import Snapshot, WorkerLink
from ._wire import CONFIG, DRAIN, READY, WorkerSettings

logger = logging.getLogger("trioserve.workers")

_RESTART_BACKOFF_S = 1.0  # a worker that dies this soon after starting waits this long
_PULL_TIMEOUT_S = 1.0  # a scrape waits this long for a worker's counters


class WorkerStartError(Exception):
    """A worker died before it served: the server cannot start."""


@dataclass(frozen=True)
class Ports:
    http: list[Address]
    grpc: list[Address]
    metrics: list[Address]


class WorkerPool:
    """``count`` workers serving ``config``'s HTTP, gRPC and metrics ports for this core."""

    def __init__(
        self,
        count: int,
        config: ServerConfig,
        context: ServerContext,
        rest_app: RestApp,
        methods: Mapping[str, Method],
        log_level: int,
    ) -> None:
        self.count = count
        self._config = config
        self._context = context
        self._rest_app = rest_app
        self._methods = with_reflection(dict(methods))
        self._log_level = log_level
        self.links: list[WorkerLink | None] = [None] * count
        self._processes: list[trio.Process | None] = [None] * count
        self.restarts = 0
        self._draining = False
        self._done = trio.Event()
        # Counters of workers that exited, so that the sums never go down.
        self._retired: Snapshot = {}
        self._latest: list[Snapshot] = [{} for _ in range(count)]

    async def run(self, *, task_status: trio.TaskStatus[Ports] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, start every worker (each READY), report the ports, and keep them
        running until ``drain`` has stopped them all."""
        config = self._config
        metrics_port = config.metrics.port if config.metrics.enabled else None
        ports = (config.http_port, metrics_port, config.grpc_port)
        sets: list[list[list[socket.socket]]] = []  # by port, then by worker
        try:
            for port in ports:
                sets.append(await _bind_sets(config.host, port, self.count))
            http_sets, metrics_sets, grpc_sets = sets
            async with trio.open_nursery() as nursery:
                for index in range(self.count):
                    listeners = _Listeners(http_sets[index], metrics_sets[index], grpc_sets[index])
                    await nursery.start(self._keep, index, listeners)
                http, metrics, grpc = (bound_addresses(port_sets[0]) for port_sets in sets)
                task_status.started(Ports(http, grpc, metrics))
        finally:
            for port_sets in sets:
                for sockets in port_sets:
                    close_all(sockets)
            self._done.set()

    async def drain(self) -> None:
        """Every worker stops accepting, finishes its calls and exits (bounded by
        ``exit_timeout_s``, then it is killed)."""
        self._draining = True
        for link in self.links:
            if link is not None:
                with contextlib.suppress(LinkClosed):
                    await link.out.send((DRAIN,))
        with trio.move_on_after(self._config.exit_timeout_s + 5):
            await self._done.wait()
        for process in self._processes:
            if process is not None and process.returncode is None:
                process.kill()

    async def _keep(
        self, index: int, listeners: _Listeners, *, task_status: trio.TaskStatus[None]
    ) -> None:
        started = False
        while not self._draining:
            began = trio.current_time()
            parent, child = channel_pair()
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "trioserve.workers", str(child.fileno())],
                pass_fds=[child.fileno()],
            )
            child.close()
            self._processes[index] = process
            # Not coalescing: the core's answers of a turn already leave as one frame
            # (``LinkInferences``), and the scheduling round a coalescing send waits cost
            # the core some 6% of its CPU per request at 8 connections.
            channel = TrioChannel(parent)
            link = WorkerLink(channel, self._context, self._rest_app, self._methods)
            try:
                settings = self._settings(index, listeners)
                await channel.send((CONFIG, settings), [s.fileno() for s in listeners.all()])
                frames = await _until_ready(channel)
            except LinkClosed:
                channel.close()
                if not started:  # it cannot start at all: say so rather than wait
                    process.kill()
                    status = await process.wait()
                    raise WorkerStartError(
                        f"front-end worker {index} exited with status {status} before serving"
                    ) from None
            else:
                self.links[index] = link
                if not started:
                    started = True
                    task_status.started()
                logger.info("front-end worker %d (pid %d) serving", index, process.pid)
                await link.serve(frames)
                self.links[index] = None
                self._retire(index)
            status = await process.wait()
            self._processes[index] = None
            if self._draining:
                return
            self.restarts += 1
            logger.error(
                "front-end worker %d (pid %d) exited with status %d: its calls in flight "
                "were withdrawn; restarting it",
                index, process.pid, status,
            )  # fmt: skip
            if trio.current_time() - began < _RESTART_BACKOFF_S:
                await trio.sleep(_RESTART_BACKOFF_S)

    def _settings(self, index: int, listeners: _Listeners) -> WorkerSettings:
        config = self._config
        tls = None
        if config.grpc_tls_certfile is not None and config.grpc_tls_keyfile is not None:
            tls = (config.grpc_tls_certfile, config.grpc_tls_keyfile)
        return WorkerSettings(
            index=index,
            host=config.host,
            http_limits=_share(config.http_limits, self.count),
            grpc_limits=_share(config.grpc_limits, self.count),
            grpc_tls=tls,
            grpc_paths={p: isinstance(m, StreamMethod) for p, m in self._methods.items()},
            http_sockets=len(listeners.http),
            metrics_sockets=len(listeners.metrics),
            exit_timeout_s=config.exit_timeout_s,
            arena_max_bytes=config.worker_arena_max_bytes,
            log_level=self._log_level,
        )

    def _retire(self, index: int) -> None:
        for group, counts in self._latest[index].items():
            totals = self._retired.setdefault(group, {})
            for name, value in counts.items():
                totals[name] = totals.get(name, 0) + value
        self._latest[index] = {}

    async def refresh_counters(self) -> None:
        """Ask every worker for its counters (a scrape's first step)."""
        async with trio.open_nursery() as nursery:
            for index, link in enumerate(self.links):
                if link is not None:
                    nursery.start_soon(self._pull, index, link)

    async def _pull(self, index: int, link: WorkerLink) -> None:
        with trio.move_on_after(_PULL_TIMEOUT_S):
            with contextlib.suppress(LinkClosed):
                self._latest[index] = await link.counters()

    def total(self, group: str, name: str) -> int:
        live = sum(latest.get(group, {}).get(name, 0) for latest in self._latest)
        return live + self._retired.get(group, {}).get(name, 0)

    def collectors(self) -> list[object]:
        """The workers' counters as the core's collectors: summed, and per worker."""
        return [
            CountersCollector("trioserve_http_", _Sum(self, "http"), HTTP_COUNTERS),
            CountersCollector("trioserve_grpc_", _Sum(self, "grpc"), GRPC_COUNTERS),
            _PerWorker(self),
        ]


@dataclass(frozen=True)
class _Listeners:
    """One worker's listening sockets, by port."""

    http: list[socket.socket]
    metrics: list[socket.socket]
    grpc: list[socket.socket]

    def all(self) -> list[socket.socket]:
        """In the order ``WorkerSettings`` reads them: HTTP, metrics, gRPC."""
        return [*self.http, *self.metrics, *self.grpc]


class _Sum:
    """One counter group summed over the workers, read as attributes."""

    def __init__(self, pool: WorkerPool, group: str) -> None:
        self._pool = pool
        self._group = group

    def __getattr__(self, name: str) -> int:
        return self._pool.total(self._group, name)


class _PerWorker:
    """Each worker's share of the calls, and the restarts."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "trioserve_worker_calls",
            "calls each front-end worker process forwarded to the core (since it started)",
            labels=["worker"],
        )
        for index, latest in enumerate(self._pool._latest):
            family.add_metric([str(index)], latest.get("worker", {}).get("forwarded", 0))
        yield family
        restarts = CounterMetricFamily(
            "trioserve_worker_restarts", "front-end worker processes restarted after dying"
        )
        restarts.add_metric([], self._pool.restarts)
        yield restarts


async def _until_ready(channel: TrioChannel) -> list[tuple[Any, list[int]]]:
    """What a starting worker sends up to its READY, without it: it starts its front ends
    one by one, each accepting at once, so its first calls may come before it says READY
    (its link serves them once it has). Raises ``LinkClosed`` if it exits first."""
    early: list[tuple[Any, list[int]]] = []
    while True:
        frames = await channel.receive()
        for position, (message, _) in enumerate(frames):
            if message[0] == READY:
                return early + frames[:position] + frames[position + 1 :]
        early += frames


_Limits = TypeVar("_Limits", HttpLimits, GrpcLimits)


def _share(limits: _Limits, count: int) -> _Limits:
    """Per-worker limits: the server's connection limit split among the workers (each
    takes its share of the connections, the kernel spreading them evenly)."""
    return replace(limits, max_connections=max(1, -(-limits.max_connections // count)))


async def _bind_sets(host: str, port: int | None, count: int) -> list[list[socket.socket]]:
    """``count`` sets of listening sockets on one port (a free one for port 0)."""
    if port is None:
        return [[] for _ in range(count)]
    if not hasattr(socket, "SO_REUSEPORT"):
        shared = await bind_tcp(host, port)
        return [shared] * count
    first = await bind_tcp(host, port, reuse_port=True)
    sets = [first]
    bound = first[0].getsockname()[1]
    try:
        for _ in range(count - 1):
            sets.append(await bind_tcp(host, bound, reuse_port=True))
    except BaseException:
        for sockets in sets:
            close_all(sockets)
        raise
    return sets
