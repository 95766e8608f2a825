"""What the server exports as Prometheus metrics, and where (frozen, validated)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

# Latency buckets in seconds: from 100 µs (a small model answered in-process) to 10 s.
DEFAULT_HISTOGRAM_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True)
class MetricsConfig:
    """``enabled`` serves ``GET /metrics`` on the HTTP port, and on ``port`` too when one is
    given (Triton's metrics port is 8002). ``latency_histograms`` adds histograms of
    request, queue and compute durations per model version with ``histogram_buckets_s``
    as bucket bounds (seconds, ascending)."""

    enabled: bool = True
    port: int | None = None
    latency_histograms: bool = True
    histogram_buckets_s: Sequence[float] = DEFAULT_HISTOGRAM_BUCKETS_S

    def __post_init__(self) -> None:
        buckets = tuple(float(b) for b in self.histogram_buckets_s)
        object.__setattr__(self, "histogram_buckets_s", buckets)
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"invalid metrics port {self.port}")
        if not buckets or not all(math.isfinite(b) and b > 0 for b in buckets):
            raise ValueError("histogram buckets must be positive, finite numbers of seconds")
        if any(a >= b for a, b in pairwise(buckets)):
            raise ValueError("histogram buckets must be in strictly ascending order")

    def histogram_bounds_ns(self) -> tuple[int, ...]:
        """The bucket bounds the statistics accumulators use; () when histograms are off."""
        if not (self.enabled and self.latency_histograms):
            return ()
        return tuple(round(b * 1e9) for b in self.histogram_buckets_s)


def metrics_config_from_flags(
    *, allow: bool, port: int | None, options: Sequence[str]
) -> MetricsConfig:
    """``--allow-metrics``, ``--metrics-port`` and each ``--metrics-config KEY=VALUE``:
    ``histogram_latencies=true|false``, ``histogram_buckets=S,S,...`` (seconds)."""
    histograms = True
    buckets: Sequence[float] = DEFAULT_HISTOGRAM_BUCKETS_S
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"--metrics-config expects KEY=VALUE, got {option!r}")
        if key == "histogram_latencies":
            histograms = _boolean(value, key)
        elif key == "histogram_buckets":
            try:
                buckets = tuple(float(v) for v in value.split(","))
            except ValueError:
                raise ValueError(f"histogram_buckets must be numbers, got {value!r}") from None
        else:
            raise ValueError(
                f"unknown --metrics-config key {key!r} "
                "(known: histogram_latencies, histogram_buckets)"
            )
    return MetricsConfig(
        enabled=allow, port=port, latency_histograms=histograms, histogram_buckets_s=buckets
    )


def _boolean(value: str, key: str) -> bool:
    if value not in ("true", "false"):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value == "true"
