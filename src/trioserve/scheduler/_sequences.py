"""The sequence batcher's state and decisions: plain data in, a decision out. No trio.

``SequenceTable`` knows the live sequences by correlation id, which of them hold one of
the batcher's slots (the others wait in a backlog, in order of their start) and the
requests each has waiting. ``decide`` picks the next batch. Times are integer
nanoseconds of ``trio.current_time()``.

Triton's semantics, which this reproduces:
- A request without START for an id that is not live is refused. A START for a live id
  continues that sequence in its slot (the earlier one ended early).
- The request flagged END ends the sequence: its id is forgotten at once (a new START
  with it is a new sequence) and its slot frees once that request has executed.
- A sequence executes one request at a time, in order, always on the same model
  instance, so a batch holds at most one request per sequence and runs on one free
  instance. ``direct``: a slot belongs to an instance, and a batch is the waiting
  requests of the slots of one. ``oldest``: the oldest waiting requests among the
  slotted sequences of one instance (a sequence joins the instance of its first
  batch), up to ``max_batch_size``.
- A batch goes at once when it is full or has no delay to wait; otherwise when its
  oldest request has waited ``max_queue_delay`` or a prefix reaches a preferred size.
- A live sequence with nothing waiting or executing for ``idle`` (since its last
  request arrived or finished executing, whichever is later) is released.

Beyond Triton: model instances that are down (``avoided``, a process restarting or
given up on; never all of them) take no new sequence, neither a ``direct`` slot of
theirs nor an ``oldest`` first batch. A sequence already on one stays there (its
requests wait for the restart, or fail naming the instance).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from ._batching import QueuedItem, Wait

CorrelationId = int | str


@dataclass(frozen=True, slots=True)
class SequencePolicy:
    oldest: bool  # the ``oldest`` strategy; ``direct`` otherwise
    max_batch_size: int = 1  # 1 when the model does not batch
    slots: int = 0  # sequences that hold a slot at once; 0: unbounded
    slots_per_instance: int = 1  # direct: a batch is one instance's slots
    max_queue_delay_ns: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()  # ascending
    idle_ns: int = 1_000_000_000


@dataclass(eq=False, slots=True)
class LiveSequence:
    """One sequence; ``state`` is the runner's (its implicit state)."""

    correlation_id: CorrelationId
    last_seen_ns: int
    slot: int | None = None  # None: waiting in the backlog
    instance: int | None = None  # the model instance it runs on, once known
    pending: deque[QueuedItem] = field(default_factory=deque)
    executing: bool = False
    ended: bool = False  # its END request arrived (or it was cancelled)
    state: object = field(default=None, repr=False)


class NotStarted(Exception):
    """A request for a correlation id with no live sequence, without START."""


@dataclass(frozen=True, slots=True)
class DispatchSequences:
    """Execute the first waiting request of each of ``sequences`` as one batch, on
    model instance ``instance``."""

    sequences: list[LiveSequence]
    instance: int


class SequenceTable:
    def __init__(self, policy: SequencePolicy) -> None:
        self.policy = policy
        self._by_id: dict[CorrelationId, LiveSequence] = {}
        self._slotted: dict[int, LiveSequence] = {}  # slot -> its sequence
        self._free = list(range(policy.slots - 1, -1, -1))  # popped lowest first
        self._next_slot = policy.slots  # unbounded slots: the next one to hand out
        self._backlog: deque[LiveSequence] = deque()
        # Instances taking no new sequence, as the runner last saw them (never all).
        self.avoided: AbstractSet[int] = frozenset()

    def __len__(self) -> int:
        """Live sequences (by id)."""
        return len(self._by_id)

    def waiting(self) -> int:
        """Requests waiting to execute."""
        sequences = [*self._slotted.values(), *self._backlog]
        return sum(len(s.pending) for s in sequences)

    def get(self, correlation_id: CorrelationId) -> LiveSequence | None:
        return self._by_id.get(correlation_id)

    def admit(
        self, correlation_id: CorrelationId, start: bool, end: bool, now_ns: int
    ) -> tuple[LiveSequence, bool]:
        """The sequence a request joins, and whether its START cut a live one short.
        The caller appends the request to ``pending``."""
        sequence = self._by_id.get(correlation_id)
        conflict = sequence is not None and start
        if sequence is None:
            if not start:
                raise NotStarted
            sequence = self._by_id[correlation_id] = LiveSequence(correlation_id, now_ns)
            self._place(sequence)
        sequence.last_seen_ns = now_ns
        if end:
            sequence.ended = True
            del self._by_id[correlation_id]
        return sequence, conflict

    def executed(self, sequence: LiveSequence, now_ns: int) -> None:
        """One request of ``sequence`` finished executing: its idle time counts from now,
        not from the request's arrival (a START may wait in the backlog for longer than
        the idle time)."""
        sequence.executing = False
        sequence.last_seen_ns = max(sequence.last_seen_ns, now_ns)
        self._release_if_done(sequence)

    def cancel(self, sequence: LiveSequence) -> list[QueuedItem]:
        """End ``sequence`` now (a request of it was cancelled); its waiting requests
        are returned for the caller to fail."""
        if self._by_id.get(sequence.correlation_id) is sequence:
            del self._by_id[sequence.correlation_id]
        sequence.ended = True
        items = list(sequence.pending)
        sequence.pending.clear()
        if sequence.slot is None and sequence in self._backlog:
            self._backlog.remove(sequence)
        self._release_if_done(sequence)
        return items

    def release_idle(self, now_ns: int) -> list[LiveSequence]:
        """Release the live sequences idle for the policy's idle time."""
        idle = [
            s
            for s in self._by_id.values()
            if not s.pending and not s.executing and s.last_seen_ns + self.policy.idle_ns <= now_ns
        ]
        for sequence in idle:
            del self._by_id[sequence.correlation_id]
            sequence.ended = True
            self._release_if_done(sequence)
        return idle

    def next_idle_ns(self) -> int | None:
        times = [
            s.last_seen_ns + self.policy.idle_ns
            for s in self._by_id.values()
            if not s.pending and not s.executing
        ]
        return min(times, default=None)

    def ready(self) -> list[LiveSequence]:
        """Slotted sequences with a request waiting and none executing, by slot."""
        return [
            self._slotted[slot]
            for slot in sorted(self._slotted)
            if self._slotted[slot].pending and not self._slotted[slot].executing
        ]

    def take(self, decision: DispatchSequences) -> list[QueuedItem]:
        """The first waiting request of each sequence of the batch, now executing."""
        items = []
        for sequence in decision.sequences:
            items.append(sequence.pending.popleft())
            sequence.executing = True
            sequence.instance = decision.instance
        return items

    def _place(self, sequence: LiveSequence) -> None:
        if not self.policy.slots:
            self._assign(sequence, self._next_slot)
            self._next_slot += 1
        else:
            self._backlog.append(sequence)
            self.fill_slots()

    def fill_slots(self) -> None:
        """Give the backlog's sequences, in order, the lowest free slots of instances
        not avoided."""
        while self._backlog and self._free:
            if self.avoided:
                slot = next((s for s in reversed(self._free) if not self._avoided(s)), None)
                if slot is None:
                    return
                self._free.remove(slot)
            else:  # the usual: no instance down, the lowest free slot in O(1)
                slot = self._free.pop()
            self._assign(self._backlog.popleft(), slot)

    def _avoided(self, slot: int) -> bool:
        return not self.policy.oldest and slot // self.policy.slots_per_instance in self.avoided

    def _assign(self, sequence: LiveSequence, slot: int) -> None:
        sequence.slot = slot
        self._slotted[slot] = sequence
        if not self.policy.oldest:  # a direct slot belongs to one instance
            sequence.instance = slot // self.policy.slots_per_instance

    def _release_if_done(self, sequence: LiveSequence) -> None:
        if not sequence.ended or sequence.executing or sequence.pending:
            return
        slot = sequence.slot
        if slot is None or self._slotted.get(slot) is not sequence:
            return
        del self._slotted[slot]
        sequence.slot = None
        if self.policy.slots:
            self._free.append(slot)
            self._free.sort(reverse=True)
            self.fill_slots()


def decide(
    ready: list[LiveSequence],
    now_ns: int,
    free_instances: AbstractSet[int],
    policy: SequencePolicy,
    avoided: AbstractSet[int] = frozenset(),
) -> DispatchSequences | Wait:
    """What to do now with the ``ready`` sequences (``SequenceTable.ready``), given the
    model instances not executing and those that take no new sequence."""
    by_age = sorted(ready, key=lambda s: s.pending[0].arrival_ns)
    welcoming = free_instances - avoided
    # The instance of the oldest request that can run now (a new sequence: any free one
    # not avoided).
    instance = next(
        (
            min(welcoming) if s.instance is None else s.instance
            for s in by_age
            if (s.instance is None and welcoming) or s.instance in free_instances
        ),
        None,
    )
    if instance is None:
        return Wait(None)
    joins = instance not in avoided  # may new sequences join this batch
    candidates = [s for s in by_age if s.instance == instance or (s.instance is None and joins)]
    key = candidates[0].pending[0].batch_key
    batch = [s for s in candidates if s.pending[0].batch_key == key][: policy.max_batch_size]
    if len(batch) >= policy.max_batch_size or not policy.max_queue_delay_ns:
        return DispatchSequences(batch, instance)
    send_at = batch[0].pending[0].arrival_ns + policy.max_queue_delay_ns
    if send_at <= now_ns:
        return DispatchSequences(batch, instance)
    preferred = [size for size in policy.preferred_batch_sizes if size <= len(batch)]
    if preferred:
        return DispatchSequences(batch[: preferred[-1]], instance)
    return Wait(send_at)
