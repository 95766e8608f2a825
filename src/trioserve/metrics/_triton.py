"""Triton's per-model inference families, read from the statistics snapshots.

Names, labels and units are Triton's (INTEROP.md): counters without ``_total`` (Triton
exports through prometheus-cpp, which adds no suffix), durations in microseconds, labels
``model`` and ``version``. Every value comes from ``ServedModel.inference_statistics()``,
the same snapshot the statistics extension serves, so the two always agree:
``nv_inference_request_duration_us`` is ``success.ns / 1000``, and so on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .._stats import FailureReason, ModelStatistics

Snapshots = Callable[[], Iterable[ModelStatistics]]

_LABELS = ("model", "version")

# (name, help, value) of the per-model counters.
_COUNTERS: tuple[tuple[str, str, Callable[[ModelStatistics], float]], ...] = (
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
        lambda s: s.success.ns / 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
        lambda s: s.queue.ns / 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        lambda s: s.compute_input.ns / 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        lambda s: s.compute_infer.ns / 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
        lambda s: s.compute_output.ns / 1000,
    ),
)

# Shown only for model versions that use the response cache, as in Triton.
_CACHE_COUNTERS: tuple[tuple[str, str, Callable[[ModelStatistics], float]], ...] = (
    (
        "nv_cache_num_hits_per_model",
        "Number of cache hits per model",
        lambda s: s.cache_hit.count,
    ),
    (
        "nv_cache_num_misses_per_model",
        "Number of cache misses per model",
        lambda s: s.cache_miss.count,
    ),
    (
        "nv_cache_hit_duration_per_model",
        "Total cache hit duration per model, in microseconds",
        lambda s: s.cache_hit.ns / 1000,
    ),
    (
        "nv_cache_miss_duration_per_model",
        "Total cache miss (insert+lookup) duration per model, in microseconds",
        lambda s: s.cache_miss.ns / 1000,
    ),
)


def unsuffixed_counter(name: str, documentation: str) -> Metric:
    """A counter family whose samples carry the family's own name (no ``_total``);
    ``exposition`` prints it as such."""
    return Metric(name, documentation, "counter")


class TritonCollector(Collector):
    """``nv_inference_*`` (and per-model ``nv_cache_*``) families of every served version."""

    def __init__(self, snapshots: Snapshots) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        stats = list(self._snapshots())
        for name, documentation, value in _COUNTERS:
            yield _counter(name, documentation, stats, value)
        failures = unsuffixed_counter(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
        )
        for s in stats:
            for reason in FailureReason:
                failures.add_sample(
                    failures.name,
                    {"model": s.name, "reason": reason.value, "version": s.version},
                    s.failures[reason],
                )
        yield failures
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            labels=_LABELS,
        )
        for s in stats:
            pending.add_metric([s.name, s.version], s.pending)
        yield pending
        cached = [s for s in stats if s.response_cache]
        if cached:
            for name, documentation, value in _CACHE_COUNTERS:
                yield _counter(name, documentation, cached, value)


def _counter(
    name: str,
    documentation: str,
    stats: list[ModelStatistics],
    value: Callable[[ModelStatistics], float],
) -> Metric:
    family = unsuffixed_counter(name, documentation)
    for s in stats:
        family.add_sample(name, {"model": s.name, "version": s.version}, value(s))
    return family
