"""The continuous-batching engine: one trio task that schedules, steps and emits.

Each iteration asks the policy for a plan, runs the model's step on it (in a worker
thread, or in trio for an ``async`` step), samples the next token of every sequence
whose tokens are all processed, turns tokens into text, applies stop conditions and
hands each request's new text to its sink. Then it sends one ``IterationStats`` down
the stats channel and goes again; with nothing to do it sleeps until a request comes.

Every request's end goes to ``Outcomes`` at once, whatever ended it: its output done, an
abort, the model failing (its step, or its tokenizer on the prompt or the output), a
fault of the engine's own work on that request (queueing it, sampling it, building its
answer: it fails alone, and the engine goes on), or the engine stopping. That is the one
place the model's statistics learn of it, so nothing ends uncounted, shutdown included
(the stats channel's reader is gone by then). An ``add`` cancelled while it tokenizes is
the one exception: the request never entered the engine, and its caller (the runner)
records it.

``add`` and ``abort`` are called from the front ends' tasks. ``add`` tokenizes the
prompt in a worker thread (user tokenizers can be slow), then both change the engine's
state directly (everything else runs on the one trio thread): an abort frees the
request's blocks at once, even while a step that includes it is in flight; the step's
results for it are then dropped.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import trio

from .._errors import (
    InferenceServerError,
    InternalError,
    InvalidArgumentError,
    UnavailableError,
)
from .._generative import GenerativeModel, SampledTokens, StepSequence
from .._load_facts import KVCacheState
from .._model_code import failure_message, model_failure
from .._stats import FailureReason
from ..tracing import GenerationRecord, Trace
from ._generation import FinishReason, GenerationChunk, GenerationRequest, TokenLogprob
from ._kv_blocks import KVBlockManager
from ._llm_output import SampleOutput
from ._llm_policy import ContinuousBatchingPolicy, SchedulerLimits, Sequence, StepPlan
from ._llm_stats import FinishedRequest, IterationStats, RequestTimes, finished_request
from ._model_calls import call_tokenizer
from ._model_steps import StepResult, call_step, device_draw, device_logprobs, step_kind
from ._sampling import (
    Draw,
    TokenHistory,
    choose_tokens,
    draws_logprobs,
    is_penalised,
    sample_generator,
)

logger = logging.getLogger("trioserve.llm")


class Sink(Protocol):
    """Where a request's output goes: a stream, or a collected response."""

    def chunk(self, chunk: GenerationChunk) -> None: ...

    def close(self) -> None: ...

    def fail(self, error: Exception) -> None: ...


class Outcomes(Protocol):
    """Where the engine records how each request ended (times in trio's clock, seconds)."""

    def finished(self, request: FinishedRequest) -> None:
        """Its output is complete ("stop", "length"), or its requester aborted it."""

    def failed(self, arrival: float, end: float, reason: FailureReason) -> None:
        """It failed: BACKEND when the model did, OTHER when the engine stopped."""


@dataclass(eq=False, slots=True)
class _Sample:
    seq: Sequence
    rng: np.random.Generator
    output: SampleOutput
    history: TokenHistory | None  # a penalised sample's, kept up as tokens are added
    finish_reason: FinishReason | None = None


# A sample to fork off a sequence whose prompt is done: (logits row, parent, index, rng).
_Fork = tuple[int, Sequence, int, np.random.Generator]


@dataclass(slots=True)
class _Due:
    """The samples that get a token from a step, known before it runs: the sequences
    whose tokens it finishes processing (``heads``, with their logits rows) and the
    samples to fork off those whose prompt it finishes; ``draws`` are the heads' then
    the forks'."""

    heads: list[tuple[int, _Sample]] = field(default_factory=list)
    forks: list[_Fork] = field(default_factory=list)
    draws: list[Draw] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class EngineRequest:
    request: GenerationRequest
    sink: Sink
    times: RequestTimes
    prompt_len: int
    stop_token: int  # EOS, or -1 with ignore_eos
    length_limit: int  # tokens (prompt and output) at which a sample ends with "length"
    samples: list[_Sample] = field(default_factory=list)
    live: int = 0  # samples not finished
    token_step: int = -1  # the last iteration that produced tokens for this request
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _StepTally:
    """Per-iteration counts, turned into IterationStats at the end of the iteration."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        model: GenerativeModel,
        stats: trio.MemorySendChannel[IterationStats] | None = None,
        *,
        seed: int | None = None,
        outcomes: Outcomes | None = None,
    ) -> None:
        self.model = model
        self._outcomes = outcomes
        self.blocks = KVBlockManager(
            model.num_kv_blocks, model.block_size, prefix_caching=model.enable_prefix_caching
        )
        self.policy = ContinuousBatchingPolicy(
            self.blocks, SchedulerLimits(model.max_num_seqs, model.max_num_batched_tokens)
        )
        self._stats = stats
        self._rng = np.random.default_rng(seed)  # seeds of unseeded samples
        self._arrivals = itertools.count()
        self._requests: set[EngineRequest] = set()
        self._work = trio.Event()
        self._step_no = 0
        self._logprob_requests = 0  # requests asking for logprobs: none, no work for them
        self.accepting = True

    def kv_cache_state(self) -> KVCacheState:
        return KVCacheState(self.blocks.num_blocks, self.blocks.num_used, self.blocks.block_size)

    async def add(self, request: GenerationRequest, sink: Sink) -> EngineRequest:
        """Tokenize ``request``'s prompt, then queue it (event QUEUED); its output goes
        to ``sink``."""
        if not self.accepting:
            raise UnavailableError(f"model '{self.model.name}' is not ready")
        if request.prompt_token_ids is not None:
            prompt = list(request.prompt_token_ids)
        else:
            prompt = await self._encode(request)
        try:
            return self._queue(request, prompt, sink)
        except InferenceServerError:
            raise  # refused: the requester hears why
        except Exception as exc:  # a fault of the engine's: this request fails, alone
            logger.exception(
                "model %r could not queue request %s", self.model.name, request.request_id
            )
            if self._outcomes is not None:
                now = trio.current_time()
                self._outcomes.failed(request.arrival_time, now, FailureReason.OTHER)
            raise InternalError(f"model '{self.model.name}' could not queue the request") from exc

    async def _encode(self, request: GenerationRequest) -> list[int]:
        """The prompt's tokens, off the event loop (``call_tokenizer``). A failing
        tokenizer is a BACKEND failure; a cancelled ``add`` is recorded by its caller,
        which knows who cancelled it (the requester, or a stopping runner)."""
        try:
            return await call_tokenizer(self.model.encode, request.prompt, self.model.name)
        except Exception as exc:
            if self._outcomes is not None:
                now = trio.current_time()
                self._outcomes.failed(request.arrival_time, now, FailureReason.BACKEND)
            raise InvalidArgumentError(f"cannot tokenize the prompt: {exc}") from exc

    def _queue(self, request: GenerationRequest, prompt: list[int], sink: Sink) -> EngineRequest:
        params = request.sampling
        if not prompt:
            raise InvalidArgumentError("the prompt is empty")
        if len(prompt) >= self.model.max_model_len:
            raise InvalidArgumentError(
                f"the prompt is {len(prompt)} tokens; model '{self.model.name}' takes "
                f"at most {self.model.max_model_len} tokens, prompt and output together"
            )
        if params.n > self.model.max_num_seqs:
            raise InvalidArgumentError(
                f"n={params.n} exceeds max_num_seqs={self.model.max_num_seqs}"
            )
        rng = sample_generator(params, 0, self._rng)  # before the engine holds anything of it
        now = trio.current_time()
        record = EngineRequest(
            request,
            sink,
            RequestTimes(request.arrival_time, now),
            len(prompt),
            stop_token=-1 if params.ignore_eos else self.model.eos_token_id,
            length_limit=min(len(prompt) + params.max_tokens, self.model.max_model_len),
        )
        seq = Sequence(
            record,
            0,
            prompt,
            len(prompt),
            request.priority,
            next(self._arrivals),
            pending_forks=params.n - 1,
        )
        record.samples.append(_Sample(seq, rng, self._output(record), _history(seq)))
        record.live = params.n
        self._requests.add(record)
        self._logprob_requests += params.logprobs is not None
        self.policy.add(seq)
        self._work.set()
        return record

    def abort(self, record: EngineRequest) -> None:
        """End ``record`` as aborted and free its blocks now; no-op once it finished."""
        if record.finished:
            return
        for s in record.samples:
            self.policy.remove(s.seq)
        tally = _StepTally()
        self._finish_request(record, "abort", trio.current_time(), tally)
        self._send_stats(trio.current_time(), tally)

    def fail_all(self, error: Exception) -> None:
        """Shutting down: every request still in the engine fails with ``error``."""
        self.accepting = False
        for record in list(self._requests):
            self._drop(record, error, FailureReason.OTHER)

    async def run(self) -> None:
        while True:
            if not self.policy.has_work:
                await self._work.wait()
                self._work = trio.Event()
                continue
            plan = self.policy.schedule()
            await self._iterate(plan)

    async def _iterate(self, plan: StepPlan) -> None:
        now = trio.current_time()
        for seq in plan.admitted:
            times = seq.owner.times
            if times.scheduled is None:
                times.scheduled = now  # SCHEDULED: the first time only
        for seq in plan.preempted:
            seq.owner.times.preemptions.append(now)  # PREEMPTED
        batch = [
            StepSequence(
                seq.token_ids[seq.num_computed : seq.num_computed + n], seq.num_computed, seq.blocks
            )
            for seq, n in plan.chunks
        ]
        if not batch:  # everything running was just preempted; admission comes next
            await trio.lowlevel.checkpoint()
            return
        try:
            due = self._due(plan)
            kind = step_kind(self.model, due.draws)
            device = [device_draw(d) for d in due.draws] if kind == "device" else []
        except Exception as exc:  # a fault of the engine's: the step's requests fail, alone
            self._fault(plan, "prepare a step", exc)
            return
        try:
            result = await call_step(self.model, batch, kind, device)
        except Exception as exc:
            self._fail_step(plan, exc)
            return
        now = trio.current_time()
        self._step_no += 1
        tally = _StepTally()
        prefilling = sum(1 for seq, _ in plan.chunks if seq.num_computed < seq.prompt_len)
        try:
            self._apply(plan, result, due, now, tally)
        except Exception as exc:  # a fault of the engine's: the step's requests fail, alone
            self._fault(plan, "apply a step", exc)
        self._send_stats(now, tally, plan, prefilling)

    def _fault(self, plan: StepPlan, doing: str, exc: Exception) -> None:
        logger.exception("model %r: could not %s", self.model.name, doing)
        error = InternalError(f"model '{self.model.name}' failed to {doing}: {exc}")
        for record in {seq.owner for seq, _ in plan.chunks}:
            self._drop(record, error, FailureReason.OTHER)

    def _due(self, plan: StepPlan) -> _Due:
        """Who gets a token from the step of ``plan``: the sequences whose tokens it
        finishes processing, and the samples to fork off those whose prompt it finishes
        (their generators made now)."""
        due = _Due()
        for row, (seq, count) in enumerate(plan.chunks):
            if seq.num_computed + count < len(seq.token_ids):
                continue  # a prompt chunk: more of it to process first
            record: EngineRequest = seq.owner
            due.heads.append((row, record.samples[seq.index]))
            params = record.request.sampling
            for index in range(params.n - seq.pending_forks, params.n):
                due.forks.append((row, seq, index, sample_generator(params, index, self._rng)))
        due.draws = [
            Draw(row, s.seq.owner.request.sampling, s.rng, s.seq.token_ids, s.history)
            for row, s in due.heads
        ] + [
            # A fork draws its first token from the prompt, its parent's history so far.
            Draw(row, parent.owner.request.sampling, rng, parent.token_ids,
                 parent.owner.samples[parent.index].history)
            for row, parent, _, rng in due.forks
        ]  # fmt: skip
        return due

    def _fail_step(self, plan: StepPlan, exc: Exception) -> None:
        """The model failed: its batch's requests fail, the engine goes on."""
        logger.warning("model %r step failed: %r", self.model.name, exc)
        error = InternalError(failure_message(self.model.name, exc))
        for record in {seq.owner for seq, _ in plan.chunks}:
            self._drop(record, error, FailureReason.BACKEND)

    def _drop(self, record: EngineRequest, error: Exception, reason: FailureReason) -> None:
        if record.finished:
            return
        for s in record.samples:
            self.policy.remove(s.seq)
        record.finish_reason = "abort"
        self._forget(record)
        now = trio.current_time()
        if self._outcomes is not None:
            self._outcomes.failed(record.times.arrival, now, reason)
        if record.request.trace is not None:  # a failed request's trace too, as Triton's
            made = sum(s.seq.num_output for s in record.samples)
            _end_trace(record, record.request.trace, now, "abort", made)
        record.sink.fail(error)

    def _forget(self, record: EngineRequest) -> None:
        """``record`` finished: the engine holds it no more."""
        self._requests.discard(record)
        self._logprob_requests -= record.request.sampling.logprobs is not None

    @trio.lowlevel.enable_ki_protection  # it decodes with the model's tokenizer
    def _apply(
        self, plan: StepPlan, result: StepResult, due: _Due, now: float, tally: _StepTally
    ) -> None:
        # Sequences whose tokens are all processed now get their next token; the other
        # samples of a request fork off its first once its prompt is done. Requests
        # aborted while the step ran are passed over.
        for seq, count in plan.chunks:
            if not seq.owner.finished:
                self.policy.computed(seq, count)
        heads, forks = due.heads, due.forks
        tokens, logprobs = self._choose(result, due.draws, heads, forks)
        accepted = []
        for (_, s), token, logprob in zip(heads, tokens, logprobs, strict=False):
            if token is None or s.seq.owner.finished:
                continue  # its request failed in sampling, or was aborted
            s.seq.token_ids.append(token)
            if s.history is not None:
                s.history.add(token)
            accepted.append((s, token, logprob))
        # Fork before accepting: a first sample that finishes frees the prompt's blocks.
        for (_, parent, index, rng), token, logprob in zip(
            forks, tokens[len(heads) :], logprobs[len(heads) :], strict=True
        ):
            record = parent.owner
            if token is None or record.finished:
                continue
            forked = self.policy.fork(parent, index, token)
            child = _Sample(forked, rng, self._output(record), _history(forked))
            record.samples.append(child)
            accepted.append((child, token, logprob))
        tally.generation_tokens += len(accepted)
        for s, token, logprob in accepted:
            record = s.seq.owner
            if record.finished:
                continue  # another of its samples failed below
            self._new_tokens(record, now, tally)
            # The model's tokenizer may fail, or give text that cannot be answered (a
            # lone surrogate in a collected response): then this request fails.
            try:
                self._accept(record, s, token, logprob, tally, now)
            except BaseException as exc:  # the model's tokenizer failed: this request fails
                exc = model_failure(exc, self.model.name, "in its tokenizer")
                logger.warning("model %r decode failed: %r", self.model.name, exc)
                error = InternalError(failure_message(self.model.name, exc))
                self._drop(record, error, FailureReason.BACKEND)

    def _choose(
        self,
        logits: StepResult,
        draws: list[Draw],
        heads: list[tuple[int, _Sample]],
        forks: list[_Fork],
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Each draw's token and logprobs (``draws`` are the ``heads``' then the
        ``forks``'), all in one pass. Should that pass fail, each draw is tried alone and
        the requests whose draws fail fail (token None); the others go on (their seeded
        draws are then no longer repeatable)."""
        try:
            return self._choose_all(logits, draws)
        except Exception:
            if isinstance(logits, SampledTokens):
                raise  # tokens drawn together are not drawn again one by one
            logger.exception("model %r: sampling a step failed; sampling alone", self.model.name)
        owners = [s.seq.owner for _, s in heads] + [parent.owner for _, parent, _, _ in forks]
        tokens: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        for draw, record in zip(draws, owners, strict=True):
            try:
                (token,), (logprob,) = self._choose_all(logits, [draw])
            except Exception as exc:
                error = InternalError(f"model '{self.model.name}' failed to sample: {exc}")
                self._drop(record, error, FailureReason.OTHER)
                token, logprob = None, None
            tokens.append(token)
            logprobs.append(logprob)
        return tokens, logprobs

    def _choose_all(
        self, logits: StepResult, draws: list[Draw]
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        if isinstance(logits, SampledTokens):  # drawn on the model's device (step_sample)
            return [*map(int, logits.tokens)], device_logprobs(logits, draws)
        if logits.ndim == 1:  # the model chose greedy tokens on its device (step_greedy)
            return [int(logits[d.row]) for d in draws], [None] * len(draws)
        tokens = choose_tokens(logits, draws)
        logprobs: list[TokenLogprob | None] = [None] * len(draws)
        if self._logprob_requests:
            logprobs = draws_logprobs(logits, draws, tokens)
        return [*tokens], logprobs

    def _output(self, record: EngineRequest) -> SampleOutput:
        return SampleOutput(self.model.decode, record.prompt_len, record.request.sampling.stop)

    def _new_tokens(self, record: EngineRequest, now: float, tally: _StepTally) -> None:
        """Event NEW_TOKENS, once per request per step."""
        if record.token_step == self._step_no:
            return
        times = record.times
        if times.first_token is None:
            times.first_token = now
            tally.ttft.append(now - times.arrival)
            tally.prompt_tokens += record.prompt_len
        else:
            assert times.last_token is not None
            tally.inter_token.append(now - times.last_token)
        times.last_token = now
        record.token_step = self._step_no

    def _accept(
        self,
        record: EngineRequest,
        s: _Sample,
        token: int,
        logprob: TokenLogprob | None,
        tally: _StepTally,
        now: float,
    ) -> None:
        """Take a sample's newest token: text, stop conditions, the sink."""
        seq = s.seq
        reason: FinishReason | None = None
        if token == record.stop_token:
            reason = "stop"
            text = s.output.flush()
        else:
            text, stopped = s.output.add(seq.token_ids)
            if stopped:
                reason = "stop"
            elif len(seq.token_ids) >= record.length_limit:
                reason = "length"
                text += s.output.flush()
        logprobs = None if logprob is None else (logprob,)
        record.sink.chunk(GenerationChunk(seq.index, text, (token,), reason, logprobs))
        if reason is not None:
            s.finish_reason = reason
            self.policy.remove(seq)
            record.live -= 1
            if record.live == 0:
                lengths = any(x.finish_reason == "length" for x in record.samples)
                self._finish_request(record, "length" if lengths else "stop", now, tally)

    def _finish_request(
        self, record: EngineRequest, reason: FinishReason, now: float, tally: _StepTally
    ) -> None:
        if reason != "abort":  # an aborted request's requester left: nobody reads its sink
            # First: should the sink fail (a collected response it cannot build), the
            # request fails, not yet counted as answered (see _apply).
            record.sink.close()
        record.finish_reason = reason
        self._forget(record)
        params = record.request.sampling
        finished = finished_request(
            record.times,
            now,
            reason,
            prompt_tokens=record.prompt_len,
            sample_tokens=[s.seq.num_output for s in record.samples],
            n=params.n,
            max_tokens=params.max_tokens,
        )
        tally.finished.append(finished)
        if self._outcomes is not None:
            self._outcomes.finished(finished)
        if record.request.trace is not None:
            made = finished.generation_tokens
            _end_trace(record, record.request.trace, now, finished.finish_reason, made)

    def _send_stats(
        self, now: float, tally: _StepTally, plan: StepPlan | None = None, prefilling: int = 0
    ) -> None:
        if self._stats is None:
            return
        self._stats.send_nowait(
            IterationStats(
                time=now,
                num_running=len(self.policy.running),
                num_waiting=len(self.policy.waiting),
                kv_used_blocks=self.blocks.num_used,
                kv_total_blocks=self.blocks.num_blocks,
                num_scheduled=len(plan.chunks) if plan else 0,
                num_prefilling=prefilling,
                num_batched_tokens=plan.num_tokens if plan else 0,
                prompt_tokens=tally.prompt_tokens,
                generation_tokens=tally.generation_tokens,
                preemptions=len(plan.preempted) if plan else 0,
                prefix_lookups=tuple(plan.prefix_lookups) if plan else (),
                reused_blocks=sum(hit for _, hit in plan.prefix_lookups) // self.blocks.block_size
                if plan
                else 0,
                time_to_first_token=tuple(tally.ttft),
                inter_token=tuple(tally.inter_token),
                finished=tuple(tally.finished),
            )
        )


def _end_trace(
    record: EngineRequest, trace: Trace, now: float, reason: FinishReason, made: int
) -> None:
    """A traced request's end (``made`` tokens generated): what vLLM's ``llm_request``
    span tells of it."""
    times = record.times
    trace.generation_finished(
        GenerationRecord(
            request_id=record.request.request_id,
            arrival=times.arrival,
            queued=times.queued,
            scheduled=times.scheduled,
            first_token=times.first_token,
            last_token=times.last_token,
            end=now,
            prompt_tokens=record.prompt_len,
            completion_tokens=made,
            finish_reason=reason,
            sampling=record.request.sampling,
        )
    )


def _history(seq: Sequence) -> TokenHistory | None:
    """A new sample's token history, if its request asks for penalties."""
    if not is_penalised(seq.owner.request.sampling):
        return None
    return TokenHistory(seq.token_ids, seq.prompt_len)
