"""The dynamic batching policy: plain data in, a decision out. No trio, no clocks.

The batcher task (``_runner.py``) owns a ``RequestQueue`` and, whenever something
changes, asks ``decide`` what to do at time ``now`` given how many model instances are
free. Times are integer nanoseconds of ``trio.current_time()``.

Triton's semantics, which this reproduces:
- Requests are taken by priority level (1 is the highest), first come first served
  within a level. A batch is the longest run from the head of that order whose requests
  share a batch key (same input names and per-item shapes) and whose batch sizes sum to
  at most ``max_batch_size``.
- The batch goes at once when it is full, when the next request cannot join it, or when
  the oldest request in it has waited ``max_queue_delay``. Before that, if a prefix of
  it has a preferred batch size, the largest such prefix goes; otherwise it waits.
- Without batching every request is its own execution, in queue order.
- A request whose queue deadline passes is taken out and timed out, even while every
  instance is busy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from itertools import repeat


@dataclass(frozen=True, slots=True)
class BatchingPolicy:
    batching: bool  # False: one request per execution
    max_batch_size: int = 1
    preferred_batch_sizes: tuple[int, ...] = ()  # ascending
    max_queue_delay_ns: int = 0
    max_queue_size: int = 0  # 0: unbounded
    default_timeout_ns: int = 0  # 0: no deadline
    priority_levels: int = 1
    default_priority_level: int = 1

    def level(self, requested: int) -> int:
        """The queue level for a requested priority (0 or out of range: the default)."""
        return requested if 1 <= requested <= self.priority_levels else self.default_priority_level

    def deadline(self, arrival_ns: int, timeout_us: int) -> int | None:
        timeout_ns = timeout_us * 1000 if timeout_us else self.default_timeout_ns
        return arrival_ns + timeout_ns if timeout_ns else None


@dataclass(slots=True, eq=False)
class QueuedItem:
    """What the policy knows of a waiting request; ``payload`` is the batcher's."""

    batch_size: int
    batch_key: Hashable
    arrival_ns: int
    level: int
    deadline_ns: int | None
    payload: object = field(default=None, repr=False)
    requests: int = 1  # the clients' requests it stands for (several, coalesced)


class RequestQueue:
    """Waiting requests, one FIFO per priority level."""

    def __init__(self, levels: int) -> None:
        self._levels: list[deque[QueuedItem]] = [deque() for _ in range(levels)]
        self._count = 0
        self._coalesced = 0  # the requests items stand for beyond one each
        # Items with a deadline: while there are none (the usual case), the deadline
        # questions asked on every decision need not look at the queue.
        self._timed = 0

    def __len__(self) -> int:
        return self._count

    @property
    def requests(self) -> int:
        """The clients' requests waiting (an item coalesced from several counts them
        all), where ``len`` counts items."""
        return self._count + self._coalesced

    def __iter__(self) -> Iterator[QueuedItem]:
        """Queue order: highest priority level first, oldest first within a level."""
        for level in self._levels:
            yield from level

    def push(self, item: QueuedItem) -> None:
        self._levels[item.level - 1].append(item)
        self._count += 1
        if item.requests != 1:
            self._coalesced += item.requests - 1
        if item.deadline_ns is not None:
            self._timed += 1

    def remove(self, item: QueuedItem) -> bool:
        try:
            self._levels[item.level - 1].remove(item)
        except ValueError:
            return False
        self._count -= 1
        if item.requests != 1:
            self._coalesced -= item.requests - 1
        if item.deadline_ns is not None:
            self._timed -= 1
        return True

    def pop_front(self, count: int) -> list[QueuedItem]:
        """Remove and return the first ``count`` items in queue order."""
        taken: list[QueuedItem] = []
        for level in self._levels:
            wanted = min(len(level), count - len(taken))
            if wanted:  # popped by ``map`` in C: no bytecode per request
                taken += map(deque.popleft, repeat(level, wanted))
        self._count -= len(taken)
        if self._coalesced:
            self._coalesced -= sum(i.requests - 1 for i in taken)
        if self._timed:
            self._timed -= sum(1 for i in taken if i.deadline_ns is not None)
        return taken

    def pop_expired(self, now_ns: int) -> list[QueuedItem]:
        if not self._timed:
            return []
        expired = [i for i in self if i.deadline_ns is not None and i.deadline_ns <= now_ns]
        for item in expired:
            self.remove(item)
        return expired

    def next_deadline(self) -> int | None:
        if not self._timed:
            return None
        return min(i.deadline_ns for i in self if i.deadline_ns is not None)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Execute the first ``count`` queued requests (in queue order) as one batch."""

    count: int


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to send yet; look again at ``until_ns`` (None: when something changes)."""

    until_ns: int | None


def decide(
    queue: RequestQueue, now_ns: int, free_instances: int, policy: BatchingPolicy
) -> Dispatch | Wait:
    """What to do now. Expired requests must already have been taken out."""
    deadline = queue.next_deadline()
    if not queue or free_instances <= 0:
        return Wait(deadline)
    if not policy.batching:
        return Dispatch(1)
    count, size, best_preferred, blocked, oldest = _head_batch(queue, policy)
    if size >= policy.max_batch_size or blocked:
        return Dispatch(count)
    send_at = oldest + policy.max_queue_delay_ns
    if send_at <= now_ns:
        return Dispatch(count)
    if best_preferred:
        return Dispatch(best_preferred)
    return Wait(send_at if deadline is None else min(send_at, deadline))


def _head_batch(queue: RequestQueue, policy: BatchingPolicy) -> tuple[int, int, int, bool, int]:
    """(requests, batch size, count giving the largest preferred size, next can't join,
    arrival of the oldest request in the batch)."""
    count = size = best_preferred = 0
    oldest = 0
    key: Hashable = None
    # The policy's figures in locals: the loop runs for every queued request.
    limit = policy.max_batch_size
    preferred = policy.preferred_batch_sizes
    for item in queue:
        if count:
            if item.batch_key != key or size + item.batch_size > limit:
                return count, size, best_preferred, True, oldest
            if item.arrival_ns < oldest:  # a lower priority level's request can be older
                oldest = item.arrival_ns
        else:
            if item.batch_size > limit:  # cannot happen after validation
                return 1, item.batch_size, 0, True, item.arrival_ns  # it goes alone
            oldest = item.arrival_ns
            key = item.batch_key
        count += 1
        size += item.batch_size
        if size in preferred:
            best_preferred = count
    return count, size, best_preferred, False, oldest
