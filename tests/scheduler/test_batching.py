"""The batching policy as a pure function: queue state and time in, decision out."""

from trioserve.scheduler._batching import (
    BatchingPolicy,
    Dispatch,
    QueuedItem,
    RequestQueue,
    Wait,
    decide,
)

MS = 1_000_000


def _queue(*items: QueuedItem, levels: int = 1) -> RequestQueue:
    queue = RequestQueue(levels)
    for item in items:
        queue.push(item)
    return queue


def _item(arrival_ms: float = 0, size: int = 1, key: str = "a", level: int = 1, deadline_ms=None):
    deadline = None if deadline_ms is None else int(deadline_ms * MS)
    return QueuedItem(size, key, int(arrival_ms * MS), level, deadline)


BATCH8 = BatchingPolicy(batching=True, max_batch_size=8, max_queue_delay_ns=2 * MS)


def test_waits_for_the_queue_delay_then_sends_what_it_has():
    queue = _queue(_item(0), _item(0.5))
    assert decide(queue, int(1 * MS), 1, BATCH8) == Wait(2 * MS)
    assert decide(queue, 2 * MS, 1, BATCH8) == Dispatch(2)


def test_full_batch_goes_at_once():
    queue = _queue(*[_item(0, size=2) for _ in range(4)])
    assert decide(queue, 0, 1, BATCH8) == Dispatch(4)


def test_a_request_that_cannot_join_sends_the_batch_before_it():
    assert decide(_queue(_item(0, 5), _item(0, 4)), 0, 1, BATCH8) == Dispatch(1)
    assert decide(_queue(_item(0, key="a"), _item(0, key="b")), 0, 1, BATCH8) == Dispatch(1)


def test_no_delay_sends_immediately():
    policy = BatchingPolicy(batching=True, max_batch_size=8)
    assert decide(_queue(_item(0)), 0, 1, policy) == Dispatch(1)


def test_nothing_goes_while_every_instance_is_busy():
    queue = _queue(*[_item(0) for _ in range(8)])
    assert decide(queue, 10 * MS, 0, BATCH8) == Wait(None)


def test_largest_preferred_size_reached_goes_before_the_delay():
    policy = BatchingPolicy(
        batching=True, max_batch_size=8, preferred_batch_sizes=(2, 4), max_queue_delay_ns=10 * MS
    )
    assert decide(_queue(_item(0)), 0, 1, policy) == Wait(10 * MS)
    assert decide(_queue(*[_item(0) for _ in range(3)]), 0, 1, policy) == Dispatch(2)
    assert decide(_queue(*[_item(0) for _ in range(5)]), 0, 1, policy) == Dispatch(4)
    # Once the delay has passed, everything that fits goes, preferred or not.
    assert decide(_queue(*[_item(0) for _ in range(5)]), 10 * MS, 1, policy) == Dispatch(5)


def test_without_batching_each_request_is_its_own_execution():
    policy = BatchingPolicy(batching=False)
    assert decide(_queue(_item(0), _item(0)), 0, 1, policy) == Dispatch(1)


def test_priority_levels_order_the_queue():
    policy = BatchingPolicy(batching=True, max_batch_size=2, priority_levels=2)
    low, high = _item(0, level=2), _item(1, level=1)
    queue = _queue(low, high, levels=2)
    assert list(queue) == [high, low]
    assert decide(queue, 0, 1, policy) == Dispatch(2)
    assert queue.pop_front(1) == [high]


def test_deadlines_wake_the_batcher_and_expire():
    queue = _queue(_item(0, deadline_ms=1), _item(0, deadline_ms=5))
    assert decide(queue, 0, 0, BATCH8) == Wait(1 * MS)
    assert decide(queue, 0, 1, BATCH8) == Wait(1 * MS)  # before the 2 ms delay
    expired = queue.pop_expired(1 * MS)
    assert [i.deadline_ns for i in expired] == [1 * MS]
    assert len(queue) == 1


def test_policy_levels_and_deadlines():
    policy = BatchingPolicy(
        batching=True, priority_levels=3, default_priority_level=2, default_timeout_ns=7 * MS
    )
    assert [policy.level(p) for p in (0, 1, 3, 4)] == [2, 1, 3, 2]
    assert policy.deadline(10, 0) == 10 + 7 * MS
    assert policy.deadline(10, 5) == 10 + 5_000
    assert BatchingPolicy(batching=False).deadline(10, 0) is None


def test_queue_remove():
    item = _item(0)
    queue = _queue(item)
    assert queue.remove(item)
    assert not queue.remove(item)
    assert len(queue) == 0


def test_deadlines_are_tracked_as_items_come_and_go() -> None:
    plain, late, early = _item(0), _item(0, deadline_ms=5), _item(0, deadline_ms=3)
    queue = _queue(plain, late, early)
    assert queue.next_deadline() == 3 * MS
    assert queue.pop_front(2) == [plain, late]
    assert queue.next_deadline() == 3 * MS
    assert queue.remove(early)
    assert queue.next_deadline() is None
    assert queue.pop_expired(10 * MS) == []
    queue.push(late)
    assert queue.pop_expired(4 * MS) == []
    assert queue.pop_expired(5 * MS) == [late]
    assert (len(queue), queue.next_deadline()) == (0, None)


def test_the_oldest_request_of_the_batch_sets_the_delay_across_levels() -> None:
    # The level 1 request arrived last; the level 2 one has waited since 0 ms.
    queue = _queue(_item(0, level=2), _item(1.5, level=1), levels=2)
    policy = BatchingPolicy(
        batching=True, max_batch_size=8, max_queue_delay_ns=2 * MS, priority_levels=2
    )
    assert decide(queue, 1 * MS, 1, policy) == Wait(2 * MS)
    assert decide(queue, 2 * MS, 1, policy) == Dispatch(2)


def test_the_queue_counts_the_requests_a_coalesced_item_stands_for() -> None:
    queue = RequestQueue(levels=2)
    coalesced, lone, other = _item(size=3), _item(level=2), _item(size=4)
    coalesced.requests, other.requests = 3, 4
    for item in (coalesced, lone, other):
        queue.push(item)
    assert (len(queue), queue.requests) == (3, 8)
    assert queue.remove(other) and (len(queue), queue.requests) == (2, 4)
    assert queue.pop_front(1) == [coalesced]
    assert (len(queue), queue.requests) == (1, 1)
    assert queue.pop_front(1) == [lone] and queue.requests == 0
