"""The server's collector of its Python-backend models' custom metrics, on its
``/metrics``: the families ``pb_utils.MetricFamily`` makes (``_pb_metrics``), in the
model's thread or forwarded from its instance process."""

from __future__ import annotations

import threading
import weakref

from prometheus_client.metrics_core import Metric as PrometheusFamily
from prometheus_client.registry import Collector

from ._pb_metrics import _TYPE_NAMES, HISTOGRAM, Metric, MetricError, _FamilyState


class CustomMetrics(Collector):
    """The families the models of one server made, by name."""

    def __init__(self) -> None:
        self._families: dict[str, _FamilyState] = {}
        self._lock = threading.Lock()  # models make families from worker threads
        # Models that stopped serving: what their finalize still makes or changes counts,
        # unexported (a family of theirs outliving them on /metrics would be stale).
        self._released: weakref.WeakSet[object] = weakref.WeakSet()

    def family(self, name: str, description: str, kind: int, owner: object) -> _FamilyState:
        with self._lock:
            if owner in self._released:
                return _FamilyState(name, description, kind)
            state = self._families.get(name)
            if state is None:
                state = self._families[name] = _FamilyState(name, description, kind)
            elif state.kind != kind:
                raise MetricError(
                    f"metric family '{name}' already exists as a {_TYPE_NAMES[state.kind]}"
                )
            state.owners.add(id(owner))
            return state

    def release(self, owner: object) -> None:
        """``owner`` stopped serving (or failed to load): forget the families no other
        owner holds, and export nothing it makes or changes from now on."""
        with self._lock:
            self._released.add(owner)
            for name, state in list(self._families.items()):
                state.owners.discard(id(owner))
                if not state.owners:
                    del self._families[name]

    def collect(self) -> list[PrometheusFamily]:
        with self._lock:
            states = list(self._families.values())
        return [_exported(state) for state in states]


def _exported(state: _FamilyState) -> PrometheusFamily:
    # Counters keep their own name (no ``_total``), as Triton exports them.
    family = PrometheusFamily(state.name, state.description, _TYPE_NAMES[state.kind])
    with state.lock:
        series = list(state.metrics.items())
    for key, metric in series:
        _add_samples(state, metric, family, dict(key))
    return family


def _add_samples(
    state: _FamilyState, metric: Metric, family: PrometheusFamily, labels: dict[str, str]
) -> None:
    name = state.name
    value, bounds, counts = metric.snapshot()
    if state.kind != HISTOGRAM:
        family.add_sample(name, labels, value)
        return
    cumulative = 0
    for bound, count in zip([*bounds, float("inf")], counts, strict=True):
        cumulative += count
        family.add_sample(
            f"{name}_bucket",
            {**labels, "le": "+Inf" if bound == float("inf") else repr(bound)},
            cumulative,
        )
    family.add_sample(f"{name}_count", labels, cumulative)
    family.add_sample(f"{name}_sum", labels, value)
