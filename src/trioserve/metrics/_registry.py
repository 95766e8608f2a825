"""A server instance's ``CollectorRegistry`` and its text exposition.

Each server builds its own registry (never prometheus_client's global one), so two
servers in one process report separately. It holds the Triton families of every served
model version, the latency histograms and host metrics; the server adds its LLM families
(``LLMMetricFamilies``) and the Python backend's custom metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .._metrics_config import MetricsConfig
from .._served import ModelRepository
from .._stats import ModelStatistics
from ._histograms import LatencyHistogramCollector
from ._system import CpuCollector, gpu_collector
from ._tasks import TaskCollector
from ._triton import TritonCollector

# The Prometheus text format, version 0.0.4, which is what ``exposition`` writes.
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def server_registry(repository: ModelRepository, config: MetricsConfig) -> CollectorRegistry:
    def snapshots() -> Iterator[ModelStatistics]:
        for served in repository:
            yield served.inference_statistics()

    registry = CollectorRegistry()
    registry.register(TritonCollector(snapshots))
    if config.latency_histograms:
        registry.register(LatencyHistogramCollector(snapshots))
    registry.register(CpuCollector())
    registry.register(TaskCollector())
    gpus = gpu_collector()
    if gpus is not None:
        registry.register(gpus)
    return registry


class _SingleFamily(Collector):
    def __init__(self, family: Metric) -> None:
        self._family = family

    def collect(self) -> list[Metric]:
        return [self._family]


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format (``rendered``)."""
    return rendered(registry.collect())


def rendered(families: Iterable[Metric]) -> bytes:
    """Collected families in the Prometheus text format (a front-end worker renders those
    the core collected).

    prometheus_client's writer prints every counter as ``<name>_total``. A counter family
    whose samples carry the family's own name (Triton's, from ``unsuffixed_counter``) is
    printed with that name instead, as Triton prints it; every other family exactly as
    prometheus_client prints it.
    """
    parts = []
    for family in families:
        if family.type == "counter" and all(s.name == family.name for s in family.samples):
            as_gauge = Metric(family.name, family.documentation, "gauge")
            as_gauge.samples = family.samples
            text = generate_latest(_SingleFamily(as_gauge))
            gauge_line = f"# TYPE {family.name} gauge\n".encode()
            parts.append(text.replace(gauge_line, f"# TYPE {family.name} counter\n".encode(), 1))
        else:
            parts.append(generate_latest(_SingleFamily(family)))
    return b"".join(parts)
