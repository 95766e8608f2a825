"""Counters a front end keeps as plain integers (what clients did wrong, what a limit
refused), exported as Prometheus counters at each scrape: nothing on the hot path but
``+= 1``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily


class CountersCollector:
    """``statistics``'s integer attributes named in ``descriptions``, as counters called
    ``prefix`` + name (``_total`` is added by the exposition)."""

    def __init__(self, prefix: str, statistics: object, descriptions: Mapping[str, str]) -> None:
        self._prefix = prefix
        self._statistics = statistics
        self._descriptions = descriptions

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, description in self._descriptions.items():
            family = CounterMetricFamily(self._prefix + name, description)
            family.add_metric([], getattr(self._statistics, name))
            yield family
