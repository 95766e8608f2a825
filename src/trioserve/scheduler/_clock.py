"""The scheduler's one view of time: integer nanoseconds of ``trio.current_time()``.

Reading time only here is what lets tests drive batching with ``trio.testing.MockClock``.
"""

from __future__ import annotations

import trio


def now_ns() -> int:
    return round(trio.current_time() * 1e9)


def ns_to_seconds(ns: int) -> float:
    return ns / 1e9
