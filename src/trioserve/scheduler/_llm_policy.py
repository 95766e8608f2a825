"""Which sequences run in the next engine step, and how many of their tokens.

One ``Sequence`` is one sample of one request: its tokens (prompt, then output), how
many of them the KV cache holds (``num_computed``) and its block table. A request with
``n > 1`` starts as one sequence that carries ``pending_forks``; once its prompt is
processed the engine forks the other samples off it, sharing the prompt's full blocks.

Each step (``ContinuousBatchingPolicy.schedule``):

1. Running sequences first, in admission order: each gets its remaining prompt chunk
   or its one decode token, within the step's token budget. A sequence that needs a
   block when none is free preempts (by recompute) the lowest-priority, latest-arrived
   running sequence, possibly itself: its blocks are freed, its computed count reset,
   and it goes back to the waiting queue ahead of requests that arrived after it.
2. Then, unless this step preempted, waiting sequences in order (priority, then
   arrival), while the token budget, ``max_num_seqs`` and free blocks allow. Each
   starts from the longest cached prefix of its tokens; a prompt longer than the
   remaining budget is admitted with a chunk of it (chunked prefill), so long prompts
   never stall the decodes scheduled before them.

Pure state and decisions: no trio, no clock; the engine applies the plan.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ._kv_blocks import KVBlockManager, block_hash


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    owner: Any  # the engine's request record; opaque here
    index: int  # which sample of the request
    token_ids: list[int]
    prompt_len: int
    priority: int  # lower runs first
    arrival: int  # the request's arrival order
    pending_forks: int = 0  # samples still to fork off this one once its prompt is done
    num_computed: int = 0  # tokens whose K/V the cache holds
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # of its full, registered blocks
    status: SeqStatus = SeqStatus.WAITING

    @property
    def order(self) -> tuple[int, int, int]:
        """Queue order: priority, then arrival, then sample."""
        return (self.priority, self.arrival, self.index)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def slots(self) -> int:
        """Places in the batch this sequence holds, its pending samples included."""
        return 1 + self.pending_forks


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(slots=True)
class StepPlan:
    """What the next step processes: ``(sequence, number of tokens)`` in batch order."""

    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue
    preempted: list[Sequence] = field(default_factory=list)
    prefix_lookups: list[tuple[int, int]] = field(default_factory=list)  # (queried, hit) tokens

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class ContinuousBatchingPolicy:
    def __init__(self, blocks: KVBlockManager, limits: SchedulerLimits) -> None:
        self.blocks = blocks
        self.limits = limits
        self.waiting: list[Sequence] = []  # sorted by Sequence.order
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.limits.max_num_batched_tokens
        size = self.blocks.block_size
        scheduled: dict[Sequence, int] = {}
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            count = min(len(seq.token_ids) - seq.num_computed, budget)
            # Blocks to add (inline: this runs for every running sequence every step).
            need = -(-(seq.num_computed + count) // size) - len(seq.blocks)
            while need > 0 and not self.blocks.can_allocate(need):  # decodes rarely need one
                victim = max(self.running, key=_order)
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            else:
                if need > 0:
                    seq.blocks += self.blocks.allocate(need)
                scheduled[seq] = count
                budget -= count
        if not plan.preempted:
            budget = self._admit(plan, scheduled, budget)
        plan.chunks = list(scheduled.items())
        return plan

    def _admit(self, plan: StepPlan, scheduled: dict[Sequence, int], budget: int) -> int:
        if not self.waiting:
            return budget
        slots = sum(s.slots for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if slots + seq.slots > self.limits.max_num_seqs:
                break
            hit = self.blocks.lookup(seq.token_ids)
            cached = len(hit.blocks) * self.blocks.block_size
            count = min(len(seq.token_ids) - cached, budget)
            need = self.blocks.blocks_needed(cached + count, len(hit.blocks))
            if not self.blocks.can_allocate(need, reusing=hit.blocks):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.pop(0)
            self.blocks.share(hit.blocks)
            seq.blocks = hit.blocks + self.blocks.allocate(need)
            seq.hashes = hit.hashes[: len(hit.blocks)]
            seq.num_computed = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            slots += seq.slots
            scheduled[seq] = count
            budget -= count
            plan.admitted.append(seq)
            plan.prefix_lookups.append((len(seq.token_ids), cached))
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.add(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.blocks)
        seq.blocks = []
        seq.hashes = []
        seq.num_computed = 0

    def computed(self, seq: Sequence, count: int) -> None:
        """The step processed ``count`` more tokens of ``seq``: name its filled blocks."""
        seq.num_computed += count
        if not self.blocks.prefix_caching:
            return
        size = self.blocks.block_size
        for i in range(len(seq.hashes), seq.num_computed // size):
            parent = seq.hashes[-1] if seq.hashes else 0
            h = block_hash(parent, seq.token_ids[i * size : (i + 1) * size])
            self.blocks.register(seq.blocks[i], h)
            seq.hashes.append(h)

    def fork(self, parent: Sequence, index: int, first_token: int) -> Sequence:
        """A new sample of ``parent``'s request, sharing the prompt's full blocks.

        The prompt's last, partial block is not shared (each sample writes its own
        tokens after it): the new sample recomputes those few prompt tokens in its
        first step, together with its first token.
        """
        full = parent.prompt_len // self.blocks.block_size
        child = Sequence(
            parent.owner,
            index,
            [*parent.token_ids[: parent.prompt_len], first_token],
            parent.prompt_len,
            parent.priority,
            parent.arrival,
            num_computed=full * self.blocks.block_size,
            blocks=parent.blocks[:full],
            hashes=parent.hashes[:full],
            status=SeqStatus.RUNNING,
        )
        self.blocks.share(child.blocks)
        parent.pending_forks -= 1
        self.running.insert(self.running.index(parent) + 1, child)
        return child

    def remove(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted: drop it and free its blocks at once."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.pending_forks = 0
        self._release(seq)


def _order(seq: Sequence) -> tuple[int, int, int]:
    return seq.order
