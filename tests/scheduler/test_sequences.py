"""The sequence batcher's table and decisions as plain data, tested synchronously."""

from __future__ import annotations

import pytest

from trioserve.scheduler._batching import QueuedItem, Wait
from trioserve.scheduler._sequences import (
    DispatchSequences,
    LiveSequence,
    NotStarted,
    SequencePolicy,
    SequenceTable,
    decide,
)

MS = 1_000_000
OLDEST = SequencePolicy(oldest=True, max_batch_size=4, slots=3, max_queue_delay_ns=2 * MS)


def item(arrival_ms: float, key: str = "a") -> QueuedItem:
    return QueuedItem(1, key, int(arrival_ms * MS), 1, None)


def join(table: SequenceTable, cid: int | str, at_ms: float, *, start=False, end=False, key="a"):
    sequence, _ = table.admit(cid, start, end, int(at_ms * MS))
    sequence.pending.append(item(at_ms, key))
    return sequence


def ids(decision: DispatchSequences | Wait) -> list[int | str]:
    assert isinstance(decision, DispatchSequences), decision
    return [s.correlation_id for s in decision.sequences]


def test_a_request_needs_a_started_sequence():
    table = SequenceTable(OLDEST)
    with pytest.raises(NotStarted):
        table.admit(5, False, False, 0)
    first = join(table, 5, 0, start=True)
    again, conflict = table.admit(5, False, False, MS)
    assert again is first and not conflict
    restarted, conflict = table.admit(5, True, False, MS)  # continues in its slot
    assert restarted is first and conflict
    assert (first.slot, len(table)) == (0, 1)


def test_end_forgets_the_id_and_frees_the_slot_once_executed():
    table = SequenceTable(OLDEST)
    ending = join(table, 1, 0, start=True, end=True)
    with pytest.raises(NotStarted):
        table.admit(1, False, False, MS)
    fresh = join(table, 1, 1, start=True)  # a new sequence with the same id
    assert fresh is not ending and fresh.slot == 1
    table.take(DispatchSequences([ending], 0))
    assert table.ready() == [fresh]
    table.executed(ending, 0)
    assert ending.slot is None
    assert join(table, 2, 2, start=True).slot == 0  # the lowest free slot


def test_sequences_beyond_the_slots_wait_in_order_of_their_start():
    table = SequenceTable(OLDEST)  # 3 slots
    for cid in (1, 2, 3, 4, 5):
        join(table, cid, cid, start=True, end=cid == 1)
    assert [s.correlation_id for s in table.ready()] == [1, 2, 3]
    assert table.waiting() == 5
    first, second, third = decide(table.ready(), 10 * MS, {0}, OLDEST).sequences  # type: ignore[union-attr]
    taken = table.take(DispatchSequences([first, second, third], 0))
    assert [i.arrival_ns for i in taken] == [1 * MS, 2 * MS, 3 * MS]
    assert table.ready() == []  # one request per sequence executes at a time
    table.executed(second, 10 * MS)  # sequence 2 goes on: its slot stays
    table.executed(first, 10 * MS)  # sequence 1 ended: its slot goes to 4, first in the backlog
    fourth, fifth = table.get(4), table.get(5)
    assert fourth is not None and fifth is not None
    assert (fourth.slot, fifth.slot) == (0, None)
    assert [s.correlation_id for s in table.ready()] == [4]


def test_idle_sequences_are_released_at_their_time():
    policy = SequencePolicy(oldest=True, slots=1, idle_ns=100 * MS)
    table = SequenceTable(policy)
    idle = join(table, 1, 0, start=True)
    waiting = join(table, 2, 10, start=True)  # in the backlog
    assert table.next_idle_ns() is None  # both have requests waiting
    table.take(DispatchSequences([idle], 0))
    table.executed(idle, 0)
    assert table.next_idle_ns() == 100 * MS
    assert table.release_idle(100 * MS - 1) == []
    assert table.release_idle(100 * MS) == [idle]
    assert waiting.slot == 0  # the freed slot went to the backlog
    with pytest.raises(NotStarted):
        table.admit(1, False, False, 101 * MS)


def test_cancel_returns_the_waiting_requests_and_frees_the_slot():
    table = SequenceTable(OLDEST)
    sequence = join(table, 1, 0, start=True)
    sequence.pending.append(item(1))
    items = table.cancel(sequence)
    assert [i.arrival_ns for i in items] == [0, 1 * MS]
    assert sequence.slot is None and table.get(1) is None and table.waiting() == 0


def ready(*heads: tuple[int, float, str], slots_per_instance=1) -> list[LiveSequence]:
    sequences = []
    for slot, (cid, arrival_ms, key) in enumerate(heads):
        sequence = LiveSequence(cid, 0, slot=slot)
        sequence.pending.append(item(arrival_ms, key))
        sequences.append(sequence)
    return sequences


def test_oldest_batches_the_oldest_requests_across_sequences():
    candidates = ready((1, 3, "a"), (2, 1, "a"), (3, 2, "b"), (4, 0.5, "a"), (5, 4, "b"))
    assert decide(candidates, 1 * MS, {0}, OLDEST) == Wait(int(2.5 * MS))
    assert ids(decide(candidates, int(2.5 * MS), {0}, OLDEST)) == [4, 2, 1]  # 3, 5 differ
    candidates.append(ready((6, 9, "a"))[0])
    assert ids(decide(candidates, 0, {0}, OLDEST)) == [4, 2, 1, 6]  # full: at once
    assert decide(candidates, 0, set(), OLDEST) == Wait(None)  # no free instance


def test_oldest_sends_a_preferred_size_before_the_delay():
    policy = SequencePolicy(
        oldest=True, max_batch_size=8, max_queue_delay_ns=5 * MS, preferred_batch_sizes=(2, 4)
    )
    assert ids(decide(ready((1, 0, "a"), (2, 0, "a"), (3, 0, "a")), 0, {0}, policy)) == [1, 2]
    assert decide(ready((1, 0, "a")), 0, {0}, policy) == Wait(5 * MS)


def test_direct_batches_the_slots_of_one_free_instance():
    policy = SequencePolicy(oldest=False, max_batch_size=2, slots=4, slots_per_instance=2)
    # Slots 0, 1 belong to instance 0, slots 2, 3 to instance 1; slot 3 waits longest.
    candidates = ready((1, 3, "a"), (2, 2, "a"), (3, 4, "a"), (4, 1, "a"))
    for sequence in candidates:
        sequence.instance = (sequence.slot or 0) // 2
    decision = decide(candidates, 5 * MS, {0, 1}, policy)
    assert (ids(decision), decision.instance) == ([4, 3], 1)  # type: ignore[union-attr]
    decision = decide(candidates, 5 * MS, {0}, policy)  # instance 1 is busy
    assert (ids(decision), decision.instance) == ([2, 1], 0)  # type: ignore[union-attr]
    assert decide(candidates, 5 * MS, set(), policy) == Wait(None)


def test_oldest_keeps_a_sequence_on_its_instance():
    candidates = ready((1, 0, "a"), (2, 1, "a"), (3, 2, "a"))
    candidates[0].instance = 1  # its earlier requests ran on instance 1
    decision = decide(candidates, 10 * MS, {0}, OLDEST)  # 1 is busy: 1 waits for it
    assert (ids(decision), decision.instance) == ([2, 3], 0)  # type: ignore[union-attr]
    decision = decide(candidates, 10 * MS, {0, 1}, OLDEST)
    assert (ids(decision), decision.instance) == ([1, 2, 3], 1)  # type: ignore[union-attr]
    table = SequenceTable(OLDEST)
    joined = join(table, 8, 0, start=True)
    table.take(decision_for(joined, 1))
    assert joined.instance == 1  # bound by its first batch


def decision_for(sequence: LiveSequence, instance: int) -> DispatchSequences:
    return DispatchSequences([sequence], instance)


def test_the_idle_time_counts_from_the_last_execution_not_from_a_queued_start():
    policy = SequencePolicy(oldest=True, slots=1, idle_ns=100 * MS)
    table = SequenceTable(policy)
    holder = join(table, 1, 0, start=True, end=True)
    backlogged = join(table, 2, 1, start=True)  # waits for the one slot
    table.take(DispatchSequences([holder], 0))
    table.executed(holder, 500 * MS)  # the slot frees at 500 ms, long past the idle time
    assert backlogged.slot == 0
    table.take(DispatchSequences([backlogged], 0))
    table.executed(backlogged, 510 * MS)  # its START ran 509 ms after it arrived
    assert table.next_idle_ns() == 610 * MS
    assert table.release_idle(610 * MS - 1) == []
    again, _ = table.admit(2, False, False, 600 * MS)  # still live: no START needed
    assert again is backlogged


def test_new_sequences_avoid_a_down_instances_slots():
    direct = SequencePolicy(oldest=False, max_batch_size=1, slots=2, slots_per_instance=1)
    table = SequenceTable(direct)
    table.avoided = frozenset({0})  # instance 0 is down: slot 0 is its
    first = join(table, 1, 0, start=True)
    second = join(table, 2, 1, start=True)
    assert (first.slot, first.instance) == (1, 1)
    assert second.slot is None  # waits in the backlog rather than take slot 0
    table.take(DispatchSequences([first], 1))
    table.executed(first, 2 * MS)
    table.cancel(first)  # slot 1 frees: the backlog takes it
    assert (second.slot, second.instance) == (1, 1)
    table.avoided = frozenset()
    third = join(table, 3, 3, start=True)
    assert (third.slot, third.instance) == (0, 0)


def test_oldest_gives_a_new_sequence_no_down_instance():
    table = SequenceTable(OLDEST)
    pinned = join(table, 1, 0, start=True)
    pinned.instance = 0  # it ran on instance 0 before that went down
    fresh = join(table, 2, 1, start=True)
    # Instance 0 runs its own sequence alone; the new one goes to instance 1.
    decision = decide(table.ready(), 3 * MS, {0, 1}, OLDEST, avoided={0})
    assert (ids(decision), decision.instance) == ([1], 0)
    decision = decide([fresh], 3 * MS, {1}, OLDEST, avoided={0})
    assert (ids(decision), decision.instance) == ([2], 1)
    # With only the down instance free, the new sequence waits.
    assert decide([fresh], 3 * MS, {0}, OLDEST, avoided={0}) == Wait(None)
