"""Latency histograms per model version: what Triton's counters and summaries cannot give.

Counters give averages, summaries give quantiles that cannot be aggregated across
replicas; histograms give both (``histogram_quantile`` over ``sum by (le)``). Three
families, in seconds, of successful requests (cache hits included in request and
queue): end to end, in the queue, and in compute (input, infer and output together).
Their ``_count`` and ``_sum`` agree with the statistics of the same snapshot.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from .._stats import Histogram
from ._triton import Snapshots

FAMILIES = (
    ("request", "trioserve_request_duration_seconds", "End-to-end duration of successful requests"),
    ("queue", "trioserve_queue_duration_seconds", "Time successful requests waited in the queue"),
    (
        "compute",
        "trioserve_compute_duration_seconds",
        "Compute time (input, infer, output) of successful requests",
    ),
)


class LatencyHistogramCollector(Collector):
    def __init__(self, snapshots: Snapshots) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        stats = [s for s in self._snapshots() if s.histograms]
        for kind, name, documentation in FAMILIES:
            family = HistogramMetricFamily(name, documentation, labels=("model", "version"))
            for s in stats:
                histogram = s.histograms[kind]
                family.add_metric(
                    [s.name, s.version], _cumulative_buckets(histogram), histogram.sum_ns / 1e9
                )
            yield family


def _cumulative_buckets(histogram: Histogram) -> list[tuple[str, float]]:
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound_ns, count in zip(histogram.bounds_ns, histogram.counts, strict=False):
        total += count
        buckets.append((repr(bound_ns / 1e9), total))  # the shortest exact form
    buckets.append(("+Inf", total + histogram.counts[-1]))
    return buckets
