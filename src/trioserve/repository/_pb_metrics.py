"""Custom metrics of Python-backend models: ``pb_utils.MetricFamily`` and its ``Metric``s.

A server keeps its models' families in one ``CustomMetrics`` collector
(``_pb_metrics_export``), registered with that server's own registry, so they appear on
its ``/metrics`` beside Triton's families. A model reaches the collector through
``serving_metrics``, which the Python backend sets while the model's ``initialize``,
``execute`` and ``finalize`` run. In an instance process the families are local copies
whose every change is forwarded (``forward``) to the server's, which ``/metrics`` shows:
there ``value()`` is the instance's own count. As in Triton, two
families of one name are the same family (the first description stays; another kind is
an error), and a family lives as long as one loaded model version that made it: a
version's unload drops the families no other loaded version holds.
"""

from __future__ import annotations

import bisect
import contextvars
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

# What an instance process forwards of each change to a series: (family, labels, change,
# amount), the change "increment", "set" or "observe".
Forward = Callable[["_FamilyState", tuple[tuple[str, str], ...], str, float], None]

COUNTER = 0
GAUGE = 1
HISTOGRAM = 2
_TYPE_NAMES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


class MetricError(Exception):
    """A metric used against its kind, or a name Prometheus cannot carry."""


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
        self.forward: Forward | None = None

    def series(self, key: tuple[tuple[str, str], ...], buckets: Sequence[float]) -> Metric:
        """The family's metric of these labels, made on first use."""
        with self.lock:
            metric = self.metrics.get(key)
            if metric is None:
                metric = self.metrics[key] = Metric(self, buckets, key)
            return metric


# The collector of the server whose model is running on this thread (or task), and the
# model version that owns what it makes.
class Families(Protocol):
    """Where a model's families live: the server's ``CustomMetrics``
    (``_pb_metrics_export``), or an instance process's forwarder (``_pb_remote``)."""

    def family(self, name: str, description: str, kind: int, owner: object) -> _FamilyState: ...


serving_metrics: contextvars.ContextVar[tuple[Families, object]] = contextvars.ContextVar(
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
        return state.series(tuple(sorted(labels.items())), buckets or ())


class Metric:
    """One labelled series of a family: ``increment``, ``set``, ``observe``, ``value``."""

    def __init__(
        self, family: _FamilyState, buckets: Sequence[float], key: tuple[tuple[str, str], ...]
    ) -> None:
        self._family = family
        self._key = key
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
        self._forward("increment", value)

    def set(self, value: float) -> None:
        if self._family.kind != GAUGE:
            raise MetricError(f"'{self._family.name}' is not a gauge: only gauges 'set'")
        self._value = float(value)
        self._forward("set", value)

    def observe(self, value: float) -> None:
        if self._family.kind != HISTOGRAM:
            raise MetricError(
                f"'{self._family.name}' is not a histogram: only histograms 'observe'"
            )
        with self._lock:
            self._value += value  # the sum
            self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._forward("observe", value)

    def _forward(self, change: str, value: float) -> None:
        forward = self._family.forward
        if forward is not None:
            forward(self._family, self._key, change, float(value))

    def value(self) -> float:
        if self._family.kind == HISTOGRAM:
            raise MetricError(f"histogram '{self._family.name}' has no single value")
        return self._value

    def snapshot(self) -> tuple[float, list[float], list[int]]:
        """The value (a histogram's sum), the bucket bounds and the count in each bucket."""
        with self._lock:
            return self._value, self._bounds, list(self._counts)


_Series = Metric  # the name ``MetricFamily.Metric`` hides in its own class
