"""Recent activity: finished requests, failures and the time they took, over a sliding
window.

The window is a ring of one-second buckets; each remembers which whole second it
counts, so a bucket is reset the first time it is reused. Time is passed in (seconds
of ``trio.current_time()``), which keeps this module pure and testable synchronously.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import floor


@dataclass(slots=True)
class _Bucket:
    second: int = -1  # the whole second this bucket counts; -1: never used
    requests: int = 0
    errors: int = 0
    busy_s: float = 0.0  # the requests' time from arrival to outcome, summed


@dataclass(frozen=True, slots=True)
class Totals:
    """What the window holds at one moment, and over how many seconds it was gathered."""

    requests: int
    errors: int
    busy_s: float
    span_s: float  # never below one second, so a first request does not read as a burst

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.span_s

    @property
    def errors_per_second(self) -> float:
        return self.errors / self.span_s

    @property
    def in_flight(self) -> float:
        """The mean number of requests in flight over the window (Little's law)."""
        return self.busy_s / self.span_s


class RecentActivity:
    """Requests that finished in the current second and the ``window_s - 1`` before it."""

    def __init__(self, window_s: int = 10) -> None:
        if window_s < 1:
            raise ValueError("window_s must be at least 1")
        self._buckets = [_Bucket() for _ in range(window_s)]
        self._window_s = window_s  # len(self._buckets), without the call on every request
        self._first: float | None = None  # when the first request counted arrived

    def add(self, now: float, arrived: float, failed: bool, requests: int = 1) -> None:
        """``requests`` requests (one, or those coalesced into one) that arrived at
        ``arrived`` finished at ``now``, ``failed`` if in error."""
        first = self._first
        if first is None or arrived < first:
            self._first = arrived
        second = floor(now)
        bucket = self._buckets[second % self._window_s]
        if bucket.second != second:
            bucket.second, bucket.requests, bucket.errors, bucket.busy_s = second, 0, 0, 0.0
        bucket.requests += requests
        bucket.errors += failed * requests
        bucket.busy_s += (now - arrived) * requests

    def totals(self, now: float) -> Totals:
        return combined_totals([self], now)


def combined_totals(activities: Iterable[RecentActivity], now: float) -> Totals:
    """What several windows of the same length hold together (a server's, from its
    models': each request is counted once, by the model it went to)."""
    requests = errors = 0
    busy_s = 0.0
    first: float | None = None
    oldest = floor(now)
    for activity in activities:
        oldest = floor(now) - len(activity._buckets) + 1
        for bucket in activity._buckets:
            if bucket.second >= oldest:
                requests += bucket.requests
                errors += bucket.errors
                busy_s += bucket.busy_s
        if activity._first is not None and (first is None or activity._first < first):
            first = activity._first
    # The window begins at its oldest second, or later if no request had come before.
    begin = oldest if first is None else max(first, oldest)
    return Totals(requests, errors, busy_s, span_s=max(now - begin, 1.0))
