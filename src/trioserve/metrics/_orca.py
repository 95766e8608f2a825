"""ORCA load reports: the server's load, attached to responses for load balancers.

A client asks for a report with the request header ``endpoint-load-metrics-format``:

- ``json``: ``endpoint-load-metrics: JSON {...}`` carrying ``xds.data.orca.v3.OrcaLoadReport``
  by its field names only (Envoy's parser rejects unknown top-level keys): the named
  metrics first, Triton's ``kv_cache_utilization`` and ``max_token_capacity`` leading and
  printed as Triton prints them, then ``application_utilization``, ``rps_fractional``,
  ``eps``, ``cpu_utilization`` and ``mem_utilization``.
- ``text``: Triton's native form, named metrics only, ``name=value`` joined by ``", "``,
  fractions with six decimals.
- gRPC: the same report, serialized, in the trailer ``endpoint-load-metrics-bin``
  (built in ``grpc/``, which owns the generated message).

What a report says about a model comes from what the model tells of itself
(``ServedModel.load_facts``: a tensor model's runner its queue, a generative model's
engine its KV cache):

==========================  ===========================  ==============================
field                       model with a KV cache        tensor model
==========================  ===========================  ==============================
application_utilization     KV-cache blocks used / all   requests in the model (queued
                                                         or executing) per instance,
                                                         averaged over the window, at
                                                         most 1
named kv_cache_utilization  KV-cache blocks used / all   --
named max_token_capacity    blocks x tokens per block    --
named num_requests_waiting  if the model reports a queue queued requests
named num_requests_running  if the model reports a queue executing requests
==========================  ===========================  ==============================

``rps_fractional`` and ``eps`` are the whole server's requests and errors per second
over the last ``window_s`` seconds; CPU and memory come from ``_host_usage``.

Load reporting must never hurt a response: an unknown format, KV-cache figures that are
missing or negative, or any failure while building a report is logged as an error and
the response goes out without a report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from types import TracebackType
from typing import TypeVar

import trio

from .._load_facts import KVCacheState
from .._served import ServedModel
from ._host_usage import HostUsage
from ._recent import RecentActivity, combined_totals

logger = logging.getLogger("trioserve.metrics")

_T = TypeVar("_T")

FORMAT_HEADER = b"endpoint-load-metrics-format"
REPORT_HEADER = b"endpoint-load-metrics"

KV_CACHE_UTILIZATION = "kv_cache_utilization"
MAX_TOKEN_CAPACITY = "max_token_capacity"
REQUESTS_WAITING = "num_requests_waiting"
REQUESTS_RUNNING = "num_requests_running"


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One report, by ``OrcaLoadReport``'s fields; ``None``: not known, left out."""

    application_utilization: float
    rps_fractional: float
    eps: float
    cpu_utilization: float | None
    mem_utilization: float | None
    kv_cache: KVCacheState | None = None
    waiting: int | None = None
    running: int | None = None

    @property
    def named_metrics(self) -> dict[str, float]:
        """The named metrics in the order JSON prints them (Triton's first)."""
        named: dict[str, float] = {}
        if self.kv_cache is not None:
            named[KV_CACHE_UTILIZATION] = self.kv_cache.utilization
            named[MAX_TOKEN_CAPACITY] = self.kv_cache.max_token_capacity
        if self.waiting is not None and self.running is not None:
            named[REQUESTS_WAITING] = self.waiting
            named[REQUESTS_RUNNING] = self.running
        return named

    def json(self) -> str:
        """The ``JSON`` header value."""
        named = ",".join(f'"{k}":{_json_number(v)}' for k, v in self.named_metrics.items())
        fields = [f'"named_metrics":{{{named}}}'] if named else []
        for name in _STANDARD_FIELDS:
            value = getattr(self, name)
            if value is not None:
                fields.append(f'"{name}":{_json_number(value)}')
        return "JSON {" + ",".join(fields) + "}"

    def text(self) -> str:
        """The ``TEXT`` header value: Triton's form, named metrics only."""
        named = self.named_metrics
        if self.kv_cache is not None:  # exactly what Triton sends
            named = {k: named[k] for k in (KV_CACHE_UTILIZATION, MAX_TOKEN_CAPACITY)}
        if not named:
            raise _NoReport("no named metrics for a TEXT report")
        return "TEXT " + ", ".join(f"named_metrics.{k}={_text_number(v)}" for k, v in named.items())


_STANDARD_FIELDS = (
    "application_utilization", "rps_fractional", "eps", "cpu_utilization", "mem_utilization",
)  # fmt: skip


@dataclass(slots=True)
class _ModelLoad:
    activity: RecentActivity  # the model's own requests, for its utilization
    instances: int


class LoadReporter:
    """A server instance's load, as ORCA reports; its front ends share one.

    Front ends wrap each request that reaches a model in ``counting`` and ask ``report``
    for what to attach to a successful response, each in its own form: gRPC's trailer
    (``grpc/_orca.py``), REST's header (``rest/_load_report.py``).
    """

    def __init__(
        self,
        *,
        host: HostUsage | None = None,
        window_s: int = 10,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._host = host if host is not None else HostUsage()
        self._window_s = window_s
        self._clock = clock  # seconds; another clock only to run without trio (a bench)
        self._models: dict[tuple[str, str], _ModelLoad] = {}  # by model name and version
        # The same windows by served model, found faster, each with the clock its counts
        # read: a served model lives in one trio run, whose clock is asked directly rather
        # than through ``trio.current_time`` (two Python calls more, twice a request).
        self._by_served: dict[ServedModel, tuple[RecentActivity, Callable[[], float]]] = {}

    def counting(self, served: ServedModel, requests: int = 1) -> Counting:
        """A request to ``served`` arrives now: ``with`` the result (a ``Counting``)
        around the step that gives its outcome, and the request is counted when that
        step ends (as ``requests`` of them: one coalesced from several).

        Leaving with an exception counts it as an error, and so does ``failed()`` (an
        error already answered); ``uncounted()`` (a request withdrawn for a client that
        left) and a cancellation (a ``BaseException``: the client went away, the server
        stops) are not counted.
        """
        counted = self._by_served.get(served)
        if counted is None:
            clock = self._clock
            if clock is trio.current_time:
                clock = trio.lowlevel.current_clock().current_time
            counted = self._by_served[served] = (self._model(served).activity, clock)
        return Counting(*counted, requests)

    def report(self, served: ServedModel) -> LoadReport | None:
        """The report for a response of ``served``, or None (logged) if there is none."""
        return _never_failing(served, self._report)

    def _model(self, served: ServedModel) -> _ModelLoad:
        key = (served.model.name, served.version)
        model = self._models.get(key)
        if model is None:
            model = self._models[key] = _ModelLoad(
                RecentActivity(self._window_s), instances=served.model.instance_count
            )
        return model

    def _report(self, served: ServedModel) -> LoadReport:
        now = self._clock()
        model = self._model(served)
        facts = served.load_facts()
        kv_cache = _kv_cache(facts.kv_cache) if facts.kv_cache is not None else None
        waiting = running = None
        if facts.queue is not None:
            queue = facts.queue()
            waiting, running = queue.queued, queue.executing
        if kv_cache is not None:
            utilization = kv_cache.utilization
        else:
            # Requests in the model per instance (Little's law: time-averaged, whatever
            # the arrivals' pattern), at most 1: all instances busy. Past that the
            # queue grows, which ``num_requests_waiting`` tells; capping keeps the
            # weight a balancer derives (rps / utilization) at the model's throughput
            # while it drains a queue, rather than starving it of traffic.
            in_flight = model.activity.totals(now).in_flight
            utilization = min(in_flight / model.instances, 1.0)
        # The server's figures are its models' together: requests are counted only once,
        # by their model, which keeps the per-request cost to one window update.
        server = combined_totals([m.activity for m in self._models.values()], now)
        cpu, memory = self._host.sample(now)
        return LoadReport(
            application_utilization=utilization,
            rps_fractional=server.requests_per_second,
            eps=server.errors_per_second,
            cpu_utilization=cpu,
            mem_utilization=memory,
            kv_cache=kv_cache,
            waiting=waiting,
            running=running,
        )


class Counting:
    """One request's count (``LoadReporter.counting``): a class, not a generator, as it
    runs on every request."""

    __slots__ = ("_activity", "_arrived", "_clock", "_failed", "_requests", "_uncounted")

    def __init__(
        self, activity: RecentActivity, clock: Callable[[], float], requests: int = 1
    ) -> None:
        # One store a line: a tuple packed and unpacked costs more, on every request.
        self._activity = activity
        self._arrived = clock()
        self._clock = clock
        self._requests = requests
        self._failed = False
        self._uncounted = False

    def __enter__(self) -> Counting:
        return self

    def failed(self) -> None:
        """The request failed, though the block ends normally (its error was answered)."""
        self._failed = True

    def uncounted(self) -> None:
        """Nobody waits for this request's outcome any more: leave it out of the load."""
        self._uncounted = True

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._uncounted:
            return
        if kind is None:  # the usual request: one test less
            failed = self._failed
        elif issubclass(kind, Exception):
            failed = True
        else:
            return
        self._activity.add(self._clock(), self._arrived, failed, self._requests)


def _never_failing(served: ServedModel, build: Callable[[ServedModel], _T]) -> _T | None:
    """``build(served)``, or None with the reason logged: a report never fails a response."""
    try:
        return build(served)
    except _NoReport as exc:
        logger.error("model '%s': %s: no load report sent", _name(served), exc)
    except Exception:
        logger.exception("building the load report for model '%s' failed", _name(served))
    return None


class _NoReport(Exception):
    """What a report needs is missing, e.g. a generative model's KV-cache figures."""


def _kv_cache(read: Callable[[], KVCacheState | None]) -> KVCacheState:
    """The KV cache of a model that has one, as ``read`` tells it now."""
    try:
        state = read()
    except Exception as exc:
        raise _NoReport(f"no KV-cache figures ({exc!r})") from None
    if state is None:
        raise _NoReport("no KV-cache figures (None)")
    if min(state.total_blocks, state.used_blocks, state.block_size) < 0:
        raise _NoReport(f"negative KV-cache figures: {state}")
    return state


def _name(served: ServedModel) -> str:
    return served.model.name


def _text_number(value: float) -> str:
    """Triton's TEXT numbers: integers as such, fractions as C's ``%f``."""
    return str(value) if isinstance(value, int) else f"{value:f}"


def _json_number(value: float) -> str:
    """A number as Triton's JSON writer (RapidJSON) prints it.

    Integers print as integers. A double prints its shortest round-trip digits, always
    with a fraction or an exponent: ``0.75``, ``2.0``, ``0.00005`` (not Python's
    ``5e-05``), ``1e-7``, ``1e22``.
    """
    if isinstance(value, int):
        return str(value)
    text = repr(value)
    if "e" not in text:  # Python's positional form is RapidJSON's: 0.75, 2.0, 0.0001
        return text
    sign = "-" if value < 0 else ""
    shortest = Decimal(repr(abs(value))).normalize().as_tuple()
    digits = "".join(map(str, shortest.digits))
    exponent = int(shortest.exponent)  # the value is digits x 10**exponent
    point = len(digits) + exponent  # where the decimal point falls in ``digits``
    if exponent >= 0 and point <= 21:
        text = digits + "0" * exponent + ".0"
    elif 0 < point <= 21:
        text = f"{digits[:point]}.{digits[point:]}"
    elif -6 < point <= 0:
        text = "0." + "0" * -point + digits
    elif len(digits) == 1:
        text = f"{digits}e{point - 1}"
    else:
        text = f"{digits[0]}.{digits[1:]}e{point - 1}"
    return sign + text
