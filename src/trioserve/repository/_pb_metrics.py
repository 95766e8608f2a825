"""Custom metrics of Python-backend models: ``pb_utils.MetricFamily`` and its ``Metric``s.

A server keeps its models' families in one ``CustomMetrics`` collector, registered with
that server's own registry, so they appear on its ``/metrics`` beside Triton's families.
A model reaches the collector through ``serving_metrics``, which the Python backend sets
while the model's ``initialize``, ``execute`` and ``finalize`` run. As in Triton, two
families of one name are the same family (the first description stays; another kind is
an error), and a family lives as long as one loaded model version that made it: a
version's unload drops the families no other loaded version holds.
"""

from __future__ import annotations

import bisect
import contextvars
import re
import threading
from collections.abc import Mapping, Sequence

from prometheus_client.metrics_core import Metric as PrometheusFamily
from prometheus_client.registry import Collector

COUNTER = 0
GAUGE = 1
HISTOGRAM = 2
_TYPE_NAMES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


class MetricError(Exception):
    """A metric used against its kind, or a name Prometheus cannot carry."""


class CustomMetrics(Collector):
    """The families the models of one server made, by name."""

    def __init__(self) -> None:
        self._families: dict[str, _FamilyState] = {}
        self._lock = threading.Lock()  # models make families from worker threads

    def family(self, name: str, description: str, kind: int, owner: object) -> _FamilyState:
        with self._lock:
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
        """``owner`` unloaded: forget the families no other owner holds."""
        with self._lock:
            for name, state in list(self._families.items()):
                state.owners.discard(id(owner))
                if not state.owners:
                    del self._families[name]

    def collect(self) -> list[PrometheusFamily]:
        with self._lock:
            states = list(self._families.values())
        return [state.exported() for state in states]


class _FamilyState:
    def __init__(self, name: str, description: str, kind: int) -> None:
        if not _NAME.match(name):
            raise MetricError(f"metric family name '{name}' is not a valid Prometheus name")
        if kind not in _TYPE_NAMES:
            raise MetricError(f"metric family '{name}': unknown kind {kind}")
        self.name = name
        self.description = description
        self.kind = kind
        self.owners: set[int] = set()
        self.metrics: dict[tuple[tuple[str, str], ...], Metric] = {}
        self.lock = threading.Lock()

    def exported(self) -> PrometheusFamily:
        # Counters keep their own name (no ``_total``), as Triton exports them.
        family = PrometheusFamily(self.name, self.description, _TYPE_NAMES[self.kind])
        with self.lock:
            for key, metric in self.metrics.items():
                metric.add_samples(family, dict(key))
        return family


# The collector of the server whose model is running on this thread (or task), and the
# model version that owns what it makes.
serving_metrics: contextvars.ContextVar[tuple[CustomMetrics, object]] = contextvars.ContextVar(
    "serving_metrics"
)


class MetricFamily:
    """``pb_utils.MetricFamily(name, description, kind)``."""

    COUNTER = COUNTER
    GAUGE = GAUGE
    HISTOGRAM = HISTOGRAM

    def __init__(self, name: str, description: str, kind: int) -> None:
        serving = serving_metrics.get(None)
        if serving is None:  # made outside a served model: it counts, unexported
            self._state = _FamilyState(name, description, kind)
        else:
            metrics, owner = serving
            self._state = metrics.family(name, description, kind, owner)

    def Metric(  # Triton's name for it
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> _Series:
        """The family's metric of these labels (the same one for the same labels)."""
        labels = dict(labels or {})
        for label, value in labels.items():
            if not _LABEL.match(label) or label.startswith("__"):
                raise MetricError(f"metric label name '{label}' is not a valid Prometheus name")
            if not isinstance(value, str):
                raise MetricError(f"metric label '{label}' must be a string")
        state = self._state
        if state.kind == HISTOGRAM:
            if not buckets or list(buckets) != sorted(set(buckets)):
                raise MetricError(
                    f"histogram '{state.name}' needs 'buckets': increasing upper bounds"
                )
        elif buckets is not None:
            raise MetricError(f"'{state.name}' is not a histogram: it takes no buckets")
        key = tuple(sorted(labels.items()))
        with state.lock:
            metric = state.metrics.get(key)
            if metric is None:
                metric = state.metrics[key] = Metric(state, buckets or ())
            return metric


class Metric:
    """One labelled series of a family: ``increment``, ``set``, ``observe``, ``value``."""

    def __init__(self, family: _FamilyState, buckets: Sequence[float]) -> None:
        self._family = family
        self._value = 0.0
        self._bounds = [float(b) for b in buckets]
        self._counts = [0] * (len(self._bounds) + 1)  # per bucket, the last is +Inf
        self._lock = threading.Lock()

    def increment(self, value: float) -> None:
        kind = self._family.kind
        if kind == HISTOGRAM:
            raise MetricError(f"histogram '{self._family.name}' takes 'observe', not 'increment'")
        if kind == COUNTER and value < 0:
            raise MetricError(f"counter '{self._family.name}' cannot decrease")
        with self._lock:
            self._value += value

    def set(self, value: float) -> None:
        if self._family.kind != GAUGE:
            raise MetricError(f"'{self._family.name}' is not a gauge: only gauges 'set'")
        self._value = float(value)

    def observe(self, value: float) -> None:
        if self._family.kind != HISTOGRAM:
            raise MetricError(
                f"'{self._family.name}' is not a histogram: only histograms 'observe'"
            )
        with self._lock:
            self._value += value  # the sum
            self._counts[bisect.bisect_left(self._bounds, value)] += 1

    def value(self) -> float:
        if self._family.kind == HISTOGRAM:
            raise MetricError(f"histogram '{self._family.name}' has no single value")
        return self._value

    def add_samples(self, family: PrometheusFamily, labels: dict[str, str]) -> None:
        name = self._family.name
        if self._family.kind != HISTOGRAM:
            family.add_sample(name, labels, self._value)
            return
        with self._lock:
            counts, total = list(self._counts), self._value
        cumulative = 0
        for bound, count in zip([*self._bounds, float("inf")], counts, strict=True):
            cumulative += count
            family.add_sample(
                f"{name}_bucket",
                {**labels, "le": "+Inf" if bound == float("inf") else repr(bound)},
                cumulative,
            )
        family.add_sample(f"{name}_count", labels, cumulative)
        family.add_sample(f"{name}_sum", labels, total)


_Series = Metric  # the name ``MetricFamily.Metric`` hides in its own class
