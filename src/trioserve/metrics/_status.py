"""The status page's figures: one JSON document of the server and its model versions.

Counters since start tell little to a person watching; what they want is now. Each
read of the document keeps a small sample of the counters, and the next read reports
rates and latency percentiles over the interval since the oldest sample still inside
the window (``window_s``). Nothing runs while nobody looks: samples are taken only when
the document is read. The first read has no interval yet, so its rates are ``None``
and its percentiles cover everything since the server started.

Time is passed in (``trio.current_time()`` seconds), which keeps this module testable
synchronously.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._served import ModelRepository, ServedModel
from .._stats import ModelStatistics

PERCENTILES = (0.5, 0.9, 0.99)
_MAX_SAMPLES = 64  # bounds memory when many pages poll at once; rates stay exact


@dataclass(frozen=True, slots=True)
class _Counters:
    """What one model version had done at one moment."""

    success: int
    success_ns: int
    fail: int
    latency_counts: tuple[int, ...]  # the request histogram's buckets; () when off


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    counters: dict[tuple[str, str], _Counters]


def histogram_percentile(bounds_ns: Sequence[int], counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile, in nanoseconds, of observations counted per bucket (``counts``
    has one more entry than ``bounds_ns``: above every bound). Interpolated linearly
    within the bucket, as Prometheus's ``histogram_quantile`` does; a quantile that
    falls above every bound reads as the highest bound. None without observations."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    lower = 0
    for bound, count in zip(bounds_ns, counts, strict=False):
        if count and below + count >= rank:
            return lower + (bound - lower) * (rank - below) / count
        below += count
        lower = bound
    return float(bounds_ns[-1]) if bounds_ns else None


class StatusReport:
    """The status document of one server's repository, with rates over ``window_s``."""

    def __init__(
        self, repository: ModelRepository, server_metadata: dict[str, Any], *, window_s: float = 10
    ) -> None:
        self._repository = repository
        self._metadata = server_metadata
        self._window_s = window_s
        self._samples: deque[_Sample] = deque(maxlen=_MAX_SAMPLES)
        self._started: float | None = None

    def document(self, now: float) -> dict[str, Any]:
        if self._started is None:
            self._started = now
        while self._samples and self._samples[0].at < now - self._window_s:
            self._samples.popleft()
        baseline = self._samples[0] if self._samples else None
        interval = now - baseline.at if baseline is not None and now > baseline.at else None
        served = list(self._repository)
        snapshots = [s.inference_statistics() for s in served]
        counters = {(s.name, s.version): _counters(s) for s in snapshots}
        self._samples.append(_Sample(now, counters))
        models = []
        for runner, stats in zip(served, snapshots, strict=True):
            before = None
            if baseline is not None and interval is not None:
                before = baseline.counters.get((stats.name, stats.version))
            models.append(self._model(runner, stats, before, interval))
        models += self._not_served(now)
        return {
            "server": {
                "name": self._metadata.get("name", ""),
                "version": self._metadata.get("version", ""),
                "ready": self._repository.ready(),
                "watched_seconds": now - self._started,
            },
            "window_seconds": interval,
            "models": models,
        }

    def _not_served(self, now: float) -> list[dict[str, Any]]:
        """The versions loading now, then what the repository index lists but nothing
        serves: a model that failed to load (UNAVAILABLE, with the reason), one unloaded,
        one found in a repository and not loaded (state "")."""
        loading = self._repository.loading
        whole = {name for name, version in loading if version}
        entries = [
            _without_figures(name, version, "LOADING", "", loading_seconds=now - began)
            for (name, version), began in sorted(loading.items())
            if version or name not in whole  # a version's row says more than its model's
        ]
        control = self._repository.control
        for entry in control.index(ready_only=False) if control is not None else []:
            if entry["state"] not in ("READY", "LOADING"):
                entries.append(
                    _without_figures(
                        entry["name"], entry["version"], entry["state"], entry["reason"]
                    )
                )
        return entries

    def _model(
        self,
        runner: ServedModel,
        stats: ModelStatistics,
        before: _Counters | None,
        interval: float | None,
    ) -> dict[str, Any]:
        now = _counters(stats)
        since = before or _Counters(0, 0, 0, tuple(0 for _ in now.latency_counts))
        succeeded = now.success - since.success
        facts = runner.load_facts()
        document: dict[str, Any] = {
            "name": stats.name,
            "version": stats.version,
            "kind": "generative" if facts.kv_cache is not None else "tensor",
            "ready": runner.ready,
            "state": "READY" if runner.ready else "UNAVAILABLE",
            "reason": "",
            "load_seconds": self._repository.load_seconds.get((stats.name, stats.version)),
            "loading_seconds": None,
            "success": now.success,
            "fail": now.fail,
            "pending": stats.pending,
            "requests_per_second": None,
            "failures_per_second": None,
            "mean_latency_ms": (now.success_ns - since.success_ns) / succeeded / 1e6
            if succeeded
            else None,
            "latency_ms": _percentiles_ms(stats, now, since),
        }
        if before is not None and interval is not None:
            document["requests_per_second"] = (succeeded + now.fail - since.fail) / interval
            document["failures_per_second"] = (now.fail - since.fail) / interval
        if facts.kv_cache is not None:
            kv_cache = facts.kv_cache()
            document["generative"] = {
                "running": None if facts.running is None else facts.running(),
                "waiting": stats.pending,
                "kv_cache_usage": None if kv_cache is None else kv_cache.utilization,
            }
        return document


def _without_figures(
    name: str, version: str, state: str, reason: str, *, loading_seconds: float | None = None
) -> dict[str, Any]:
    """A model version that serves nothing yet: the keys of a served one, figures None."""
    return {
        "name": name,
        "version": version,
        "kind": None,
        "ready": False,
        "state": state,
        "reason": reason,
        "load_seconds": None,
        "loading_seconds": loading_seconds,
        "success": None,
        "fail": None,
        "pending": None,
        "requests_per_second": None,
        "failures_per_second": None,
        "mean_latency_ms": None,
        "latency_ms": None,
    }


def _counters(stats: ModelStatistics) -> _Counters:
    histogram = stats.histograms.get("request")
    counts = histogram.counts if histogram is not None else ()
    return _Counters(stats.success.count, stats.success.ns, stats.fail.count, counts)


def _percentiles_ms(
    stats: ModelStatistics, now: _Counters, since: _Counters
) -> dict[str, float | None] | None:
    histogram = stats.histograms.get("request")
    if histogram is None:
        return None
    counts = [a - b for a, b in zip(now.latency_counts, since.latency_counts, strict=True)]
    result: dict[str, float | None] = {}
    for q in PERCENTILES:
        ns = histogram_percentile(histogram.bounds_ns, counts, q)
        result[f"p{round(q * 100)}"] = None if ns is None else ns / 1e6
    return result
