"""Statistics of one served model version: Triton's statistics extension and histograms.

A ``ModelStats`` belongs to the object that serves one model version (the scheduler's
runner); nothing here is global. The runner reports each finished request and each
executed batch with the timestamps it took, all integer nanoseconds of
``trio.current_time()``; ``statistics()`` returns a frozen ``ModelStatistics`` that the
REST and gRPC statistics endpoints and the Prometheus collectors all read, so they can
never disagree.

The timestamps of a request, and the intervals between them::

    arrival ─ queue ─ dequeued ─ compute_input ─ input_ready ─ compute_infer ─ executed
      ─ compute_output ─ output_ready ─ (cache insertion) ─ response sent

- arrival: the runner accepted the (valid) request. Success and fail durations start here.
- dequeued: the batcher took it from the queue into a batch that holds a model instance.
- input_ready: the batch's inputs are assembled and the model is about to be called.
- executed: the model returned.
- output_ready: the responses of the batch are built.
- response sent: the request's outcome is handed to its caller. Success and fail
  durations end here; a cache miss's insertion time falls inside them.

A cache hit skips the model: it counts in success, in queue (with the time before the
lookup, which is none here) and in cache_hit (the lookup), never in inference_count,
execution_count or the compute figures. Triton's rules, from its statistics extension.
"""

from __future__ import annotations

import enum
import time
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MEMORY_TYPES = ("CPU", "CPU_PINNED", "GPU")


class FailureReason(enum.Enum):
    """Why a request ended without a response (Triton's ``reason`` label values)."""

    REJECTED = "REJECTED"  # the scheduler refused it: queue full, or its queue timeout passed
    CANCELED = "CANCELED"  # the client gave up (disconnect, deadline, cancellation)
    BACKEND = "BACKEND"  # the model's execution failed
    OTHER = "OTHER"  # anything else, e.g. the server shut down while it waited


@dataclass(frozen=True, slots=True)
class DurationStat:
    count: int = 0
    ns: int = 0


@dataclass(frozen=True, slots=True)
class BatchStat:
    """Executions of one batch size (in batch elements) and their compute durations."""

    batch_size: int
    compute_input: DurationStat
    compute_infer: DurationStat
    compute_output: DurationStat


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """Memory a model reports holding: ``kind`` is "CPU", "CPU_PINNED" or "GPU"."""

    kind: str
    id: int
    byte_size: int

    def __post_init__(self) -> None:
        if self.kind not in MEMORY_TYPES:
            raise ValueError(f"memory kind must be one of {', '.join(MEMORY_TYPES)}")
        if self.byte_size < 0:
            raise ValueError("byte_size must be >= 0")


@dataclass(frozen=True, slots=True)
class Histogram:
    """Observations per bucket: ``counts[i]`` fell at or below ``bounds_ns[i]`` and above
    the bound before it; the last count is above every bound (Prometheus's +Inf)."""

    bounds_ns: tuple[int, ...]
    counts: tuple[int, ...]
    sum_ns: int


@dataclass(slots=True)  # not frozen: built once per batch, on the hot path
class ExecutionTimes:
    """The timestamps of one executed batch, shared by each of its requests."""

    dequeued_ns: int
    input_ready_ns: int
    executed_ns: int
    output_ready_ns: int


@dataclass(frozen=True, slots=True)
class ModelStatistics:
    """A model version's statistics at one moment (Triton's ``ModelStatistics``), plus
    what the metrics need beyond it: failures by reason, queue depth, latency histograms."""

    name: str
    version: str
    last_inference: int  # ms since the epoch; 0: never
    inference_count: int
    execution_count: int
    success: DurationStat
    fail: DurationStat
    queue: DurationStat
    compute_input: DurationStat
    compute_infer: DurationStat
    compute_output: DurationStat
    cache_hit: DurationStat
    cache_miss: DurationStat
    batch_stats: tuple[BatchStat, ...]
    memory_usage: tuple[MemoryUsage, ...]
    failures: Mapping[FailureReason, int]
    pending: int  # requests waiting in the queue
    response_cache: bool  # whether this version answers from the response cache
    histograms: Mapping[str, Histogram]  # "request", "queue", "compute"; empty when off

    def as_json(self) -> dict[str, Any]:
        """Triton's ``$model_stat`` object: every value a number, the version a string."""
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {key: _duration_json(getattr(self, key)) for key in _INFER_STATS},
            "batch_stats": [
                {
                    "batch_size": b.batch_size,
                    "compute_input": _duration_json(b.compute_input),
                    "compute_infer": _duration_json(b.compute_infer),
                    "compute_output": _duration_json(b.compute_output),
                }
                for b in self.batch_stats
            ],
            "memory_usage": [
                {"type": m.kind, "id": m.id, "byte_size": m.byte_size} for m in self.memory_usage
            ],
        }


_INFER_STATS = (
    "success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
    "cache_hit", "cache_miss",
)  # fmt: skip


def statistics_document(stats: Sequence[ModelStatistics]) -> dict[str, Any]:
    """The statistics extension's response body; the gRPC front end parses the same."""
    return {"model_stats": [s.as_json() for s in stats]}


def _duration_json(stat: DurationStat) -> dict[str, int]:
    return {"count": stat.count, "ns": stat.ns}


class _Duration:
    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns * count

    def frozen(self) -> DurationStat:
        return DurationStat(self.count, self.ns)


class ModelStats:
    """The accumulators of one model version; fed by its runner, read as snapshots.

    ``histogram_bounds_ns`` (ascending bucket bounds) turns on the latency histograms of
    successful requests: end to end, in the queue, and in compute (input, infer and
    output together). Empty: no histograms, no cost.

    The per-request methods run on every request, so they only add to plain integers:
    counts that Triton's rules make equal are kept once (every success counts in queue;
    every success but a cache hit counts in the compute figures), and the histograms'
    sums are the matching totals.
    """

    def __init__(self, name: str, version: str, *, histogram_bounds_ns: Sequence[int] = ()) -> None:
        self.name = name
        self.version = version
        self.memory_usage: tuple[MemoryUsage, ...] = ()
        self._last_inference_ms = 0
        self._inference_count = 0
        self._execution_count = 0
        self._success_count = 0
        self._success_ns = 0
        self._queue_ns = 0
        self._compute_input_ns = 0
        self._compute_infer_ns = 0
        self._compute_output_ns = 0
        self._cache_hit = _Duration()
        self._cache_miss = _Duration()
        self._fail = _Duration()
        self._failures = dict.fromkeys(FailureReason, 0)
        # batch size -> [executions, compute_input ns, compute_infer ns, compute_output ns]
        self._batches: dict[int, list[int]] = {}
        self._bounds = tuple(histogram_bounds_ns)
        # Observations per bucket, the last above every bound (+Inf).
        self._request_buckets = [0] * (len(self._bounds) + 1)
        self._queue_buckets = [0] * (len(self._bounds) + 1)
        self._compute_buckets = [0] * (len(self._bounds) + 1)

    # --- what the runner reports ------------------------------------------------------

    def executed(self, batch_size: int, times: ExecutionTimes) -> None:
        """One successful execution of ``batch_size`` batch elements."""
        self._last_inference_ms = time.time_ns() // 1_000_000  # wall clock, as specified
        self._execution_count += 1
        batch = self._batches.get(batch_size)
        if batch is None:
            batch = self._batches[batch_size] = [0, 0, 0, 0]
        batch[0] += 1
        batch[1] += times.input_ready_ns - times.dequeued_ns
        batch[2] += times.executed_ns - times.input_ready_ns
        batch[3] += times.output_ready_ns - times.executed_ns

    def succeeded(
        self, arrival_ns: int, sent_ns: int, batch_size: int, times: ExecutionTimes
    ) -> None:
        """A request answered by an execution (``batch_size`` batch elements)."""
        self.batch_succeeded((arrival_ns,), sent_ns, batch_size, times)

    def batch_succeeded(
        self, arrivals_ns: Sequence[int], sent_ns: int, inferences: int, times: ExecutionTimes
    ) -> None:
        """The requests of one execution that arrived at ``arrivals_ns``, answered at
        ``sent_ns`` with ``inferences`` batch elements in all. Each reports the batch's
        compute durations, as Triton does: recorded together, the batch's figures are
        multiplied by its count rather than added once per request, to the same sums."""
        count = len(arrivals_ns)
        arrived_ns = sum(arrivals_ns)
        dequeued_ns = times.dequeued_ns
        self._inference_count += inferences
        self._success_count += count
        self._success_ns += count * sent_ns - arrived_ns
        self._queue_ns += count * dequeued_ns - arrived_ns
        self._compute_input_ns += count * (times.input_ready_ns - dequeued_ns)
        self._compute_infer_ns += count * (times.executed_ns - times.input_ready_ns)
        self._compute_output_ns += count * (times.output_ready_ns - times.executed_ns)
        bounds = self._bounds
        if bounds:
            # bisect_left: a value equal to a bound belongs to that bound's bucket (le).
            compute = bisect_left(bounds, times.output_ready_ns - dequeued_ns)
            self._compute_buckets[compute] += count
            for arrival_ns in arrivals_ns:
                self._request_buckets[bisect_left(bounds, sent_ns - arrival_ns)] += 1
                self._queue_buckets[bisect_left(bounds, dequeued_ns - arrival_ns)] += 1

    def cache_hit(self, arrival_ns: int, sent_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache (its lookup took ``lookup_ns``).
        It counts in queue with no time: the lookup happens on arrival, before any queue."""
        self._last_inference_ms = time.time_ns() // 1_000_000
        self._success_count += 1
        self._success_ns += sent_ns - arrival_ns
        self._cache_hit.add(lookup_ns)
        if self._bounds:
            self._request_buckets[bisect_left(self._bounds, sent_ns - arrival_ns)] += 1
            self._queue_buckets[0] += 1

    def cache_miss(self, lookup_and_insert_ns: int) -> None:
        """A successful response computed after a missed lookup, now in the cache."""
        self._cache_miss.add(lookup_and_insert_ns)

    def failed(
        self, arrival_ns: int, end_ns: int, reason: FailureReason, requests: int = 1
    ) -> None:
        """``requests`` requests that arrived at ``arrival_ns`` failed at ``end_ns``."""
        self._fail.add(end_ns - arrival_ns, requests)
        self._failures[reason] += requests

    # --- what readers get -------------------------------------------------------------

    def statistics(self, *, pending: int = 0, response_cache: bool = False) -> ModelStatistics:
        computed = self._success_count - self._cache_hit.count  # successes that executed
        compute_ns = self._compute_input_ns + self._compute_infer_ns + self._compute_output_ns
        histograms = {}
        if self._bounds:
            for kind, buckets, total_ns in (
                ("request", self._request_buckets, self._success_ns),
                ("queue", self._queue_buckets, self._queue_ns),
                ("compute", self._compute_buckets, compute_ns),
            ):
                histograms[kind] = Histogram(self._bounds, tuple(buckets), total_ns)
        return ModelStatistics(
            name=self.name,
            version=self.version,
            last_inference=self._last_inference_ms,
            inference_count=self._inference_count,
            execution_count=self._execution_count,
            success=DurationStat(self._success_count, self._success_ns),
            fail=self._fail.frozen(),
            queue=DurationStat(self._success_count, self._queue_ns),
            compute_input=DurationStat(computed, self._compute_input_ns),
            compute_infer=DurationStat(computed, self._compute_infer_ns),
            compute_output=DurationStat(computed, self._compute_output_ns),
            cache_hit=self._cache_hit.frozen(),
            cache_miss=self._cache_miss.frozen(),
            batch_stats=tuple(
                BatchStat(
                    size,
                    DurationStat(count, input_ns),
                    DurationStat(count, infer_ns),
                    DurationStat(count, output_ns),
                )
                for size, (count, input_ns, infer_ns, output_ns) in sorted(self._batches.items())
            ),
            memory_usage=self.memory_usage,
            failures=dict(self._failures),
            pending=pending,
            response_cache=response_cache,
            histograms=histograms,
        )
