"""What leaves the engine loop after each iteration: plain values, nothing live.

The loop sends one ``IterationStats`` per step (and one per abort) down a memory
channel; a separate task turns them into Prometheus metrics and log lines, so the loop
itself never touches a metric.

Request timing follows the engine-core events (all ``trio.current_time()``):
QUEUED (the engine received it), SCHEDULED (first taken into a step; a preempted
request keeps its first time), NEW_TOKENS (a step produced output for it). Intervals:
queue = QUEUED -> first SCHEDULED; prefill = SCHEDULED -> first NEW_TOKENS; decode =
first -> last NEW_TOKENS; inference = SCHEDULED -> last NEW_TOKENS; inter-token =
between consecutive NEW_TOKENS; TTFT and e2e are measured from the front end's
``arrival_time``. A preemption therefore lengthens the interval it falls in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._generation import FinishReason


@dataclass(slots=True)
class RequestTimes:
    """A request's event times (None until the event happened)."""

    arrival: float
    queued: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    preemptions: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    finish_reason: FinishReason
    e2e: float
    queue: float
    prefill: float
    decode: float
    inference: float
    time_per_output_token: float | None  # decode / (longest sample - 1); None below 2 tokens
    prompt_tokens: int
    generation_tokens: int  # over all samples
    max_generation_tokens: int  # the longest sample's
    n: int
    max_tokens: int


def finished_request(
    times: RequestTimes,
    now: float,
    reason: FinishReason,
    *,
    prompt_tokens: int,
    sample_tokens: list[int],
    n: int,
    max_tokens: int,
) -> FinishedRequest:
    """The record of a request that ends at ``now``.

    An aborted request may miss events: a missing event is taken as happening at
    ``now`` (a request aborted while queued has only a queue interval).
    """
    scheduled = now if times.scheduled is None else times.scheduled
    first = now if times.first_token is None else times.first_token
    last = first if times.last_token is None else times.last_token
    longest = max(sample_tokens, default=0)
    per_token = (last - first) / (longest - 1) if longest > 1 else None
    return FinishedRequest(
        finish_reason=reason,
        e2e=now - times.arrival,
        queue=scheduled - times.queued,
        prefill=first - scheduled,
        decode=last - first,
        inference=last - scheduled,
        time_per_output_token=per_token,
        prompt_tokens=prompt_tokens,
        generation_tokens=sum(sample_tokens),
        max_generation_tokens=longest,
        n=n,
        max_tokens=max_tokens,
    )


@dataclass(frozen=True, slots=True)
class IterationStats:
    time: float
    num_running: int  # sequences running after the step
    num_waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    num_scheduled: int = 0  # sequences in the step
    num_prefilling: int = 0  # of them, processing prompt tokens
    num_batched_tokens: int = 0  # tokens the step processed
    prompt_tokens: int = 0  # prompts of requests that got their first token
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_lookups: tuple[tuple[int, int], ...] = ()  # (queried, hit) tokens per admission
    reused_blocks: int = 0  # cache blocks the admissions took from the prefix cache
    time_to_first_token: tuple[float, ...] = ()
    inter_token: tuple[float, ...] = ()
    finished: tuple[FinishedRequest, ...] = field(default=())

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0
