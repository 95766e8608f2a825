"""Serves one version of one generative model: the engine's task tree and its front door.

    GenerativeRunner.run
    ├── LLMEngine.run           the continuous-batching loop
    └── telemetry.consume       per-iteration stats -> metrics and the periodic log

The engine tells the runner how each request ended (``Outcomes``), and the runner
records it in the version's ``ModelStats``, as a tensor model's runner does: the
statistics extension and the Triton metrics (``nv_inference_request_failure{reason}``,
the latency histograms) cover generative models too. A generative request counts as one
inference and one execution (batch size 1): success and fail durations are its end to
end time, queue its queue interval and compute_infer its inference interval (first
scheduled to last token). An aborted request is a CANCELED failure, a failure of the
model (its step or its tokenizer) a BACKEND one, a request the shutdown ends OTHER.

Front ends reach the engine three ways: ``generate`` (a stream of chunks, for REST
generate / generate_stream and gRPC ModelStreamInfer), and ``infer`` / ``submit`` (OIP
inference: ``text_input`` BYTES in, ``text_output`` BYTES out, one element per sample,
the request's ``parameters`` as sampling parameters).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

import numpy as np
import trio

from .._errors import CancelledError, InferenceServerError, UnavailableError
from .._generative import GenerativeModel
from .._load_facts import KVCacheState, LoadFacts
from .._model import Model
from .._served import raise_handed_over
from .._stats import ExecutionTimes, FailureReason, ModelStatistics, ModelStats
from .._tensor import datatype
from .._types import InferenceRequest, InferenceResponse, OutputTensor
from .._validation import validate_request
from ._engine import EngineRequest, LLMEngine
from ._generation import GenerationChunk, GenerationRequest
from ._generation_input import RequestIds, generation_request, prompt_and_parameters
from ._llm_stats import FinishedRequest, IterationStats
from ._model_calls import call_hook, unload
from ._sampling_params import read_parameters

_BYTES = datatype("BYTES")


class EngineTelemetry(Protocol):
    """What turns the engine's stats into metrics and logs (``metrics/`` provides one)."""

    async def consume(self, stats: trio.MemoryReceiveChannel[IterationStats]) -> None: ...


class _ChunkStream:
    """A request's chunks as an async iterator; the engine writes, the front end reads."""

    def __init__(self) -> None:
        self._send, self._receive = trio.open_memory_channel[GenerationChunk | Exception](math.inf)
        self.chunk = self._send.send_nowait  # called for every token: no extra frame

    def close(self) -> None:
        self._send.close()

    def fail(self, error: Exception) -> None:
        self._send.send_nowait(error)
        self._send.close()

    def __aiter__(self) -> _ChunkStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        if isinstance(item, Exception):
            raise item
        return item


class _CollectedTicket:
    """An OIP inference request: the engine's output is gathered into one response."""

    def __init__(self, runner: GenerativeRunner, request: InferenceRequest, n: int) -> None:
        self._runner = runner
        self._request = request
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._done = trio.Event()
        self._response: InferenceResponse | None = None
        self._error: Exception | None = None
        self.record: EngineRequest | None = None  # once admitted (its prompt tokenized)
        self.admission = trio.CancelScope()
        self._on_finished: Callable[[], object] | None = None

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> None:
        """Return once the outcome is known."""
        await self._done.wait()

    def when_finished(self, callback: Callable[[], object]) -> None:
        if self.finished:
            callback()
        else:
            self._on_finished = callback

    def after_batch(self, flush: Callable[[], object]) -> bool:
        return False  # a generation finishes on its own

    def _set_done(self) -> None:
        self._done.set()
        callback, self._on_finished = self._on_finished, None
        if callback is not None:
            callback()

    @property
    def withdrawn(self) -> bool:
        return isinstance(self._error, CancelledError)

    def answers(self) -> None:
        return None  # the model is not decoupled: its one response is collected

    def chunk(self, chunk: GenerationChunk) -> None:
        self._texts[chunk.index].append(chunk.text)

    def close(self) -> None:
        texts = np.array(["".join(t).encode() for t in self._texts], dtype=object)
        runner = self._runner
        self._response = InferenceResponse(
            runner.model.name,
            runner.version,
            [OutputTensor("text_output", _BYTES, texts)],
            id=self._request.id,
        )
        self._set_done()

    def fail(self, error: Exception) -> None:
        self._error = error
        self._set_done()

    def withdraw(self) -> None:
        """The client gave up: abort the generation and fail this ticket as cancelled."""
        if self._done.is_set():
            return
        self.fail(CancelledError("request cancelled"))
        if self.record is not None:
            self._runner.engine.abort(self.record)
        else:
            self.admission.cancel()

    def outcome(self) -> InferenceResponse:
        """The response, or the error raised (handed over: see ``Ticket.outcome``)."""
        if self._error is not None:
            raise_handed_over(self._take_error())
        assert self._response is not None
        return self._response

    def _take_error(self) -> Exception:
        """The error, taken from the ticket. A method of its own: were ``outcome`` to hold
        it in a local while raising, its frame would keep the error (and the request's
        data) in a cycle until a full collection."""
        error, self._error = self._error, None
        assert error is not None
        return error


class GenerativeRunner:
    """One generative model version: implements ``GenerativeServed``."""

    def __init__(
        self,
        model: GenerativeModel,
        version: str,
        telemetry: EngineTelemetry | None = None,
        *,
        seed: int | None = None,
        histogram_bounds_ns: Sequence[int] = (),
        request_ids: RequestIds | None = None,
    ) -> None:
        self.model: Model = model  # what ServedModel promises; the engine keeps the full type
        self.version = version
        self.ready = False
        self._telemetry = telemetry
        self.stats = ModelStats(model.name, version, histogram_bounds_ns=histogram_bounds_ns)
        self._stats_send, self._stats_receive = trio.open_memory_channel[IterationStats](math.inf)
        iterations = self._stats_send if telemetry is not None else None
        self.engine = LLMEngine(model, iterations, seed=seed, outcomes=self)
        self.engine.accepting = False
        # The server's ids (a runner of its own, as in tests, counts alone).
        self._ids = RequestIds() if request_ids is None else request_ids
        self._admissions: trio.Nursery | None = None  # tasks admitting submitted requests
        self._load_facts = LoadFacts(kv_cache=self.engine.kv_cache_state, running=self.num_running)

    def inference_statistics(self) -> ModelStatistics:
        return self.stats.statistics(pending=len(self.engine.policy.waiting))

    def kv_cache_state(self) -> KVCacheState:
        return self.engine.kv_cache_state()

    def load_facts(self) -> LoadFacts:
        return self._load_facts

    @property
    def max_num_seqs(self) -> int:
        return self.engine.model.max_num_seqs

    def num_running(self) -> int:
        """Sequences the engine is running now (vLLM's ``num_requests_running``)."""
        return len(self.engine.policy.running)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, run the engine until cancelled, then fail what is left and unload."""
        await call_hook(self.model.load, self.model.name, "in load", abandon_on_cancel=True)
        try:
            async with trio.open_nursery() as nursery:
                if self._telemetry is not None:
                    nursery.start_soon(self._telemetry.consume, self._stats_receive)
                nursery.start_soon(self.engine.run)
                self._admissions = nursery
                self.engine.accepting = self.ready = True
                task_status.started()
        finally:
            self.ready = False
            self._admissions = None
            self.engine.fail_all(UnavailableError("server is shutting down"))
            with trio.CancelScope(shield=True):
                await unload(self.model, self.version)

    async def drain(self) -> None:
        """Take no more requests; what is generating ends when the runner stops."""
        self.engine.accepting = self.ready = False
        await trio.lowlevel.checkpoint()

    # --- Outcomes: the engine reports every request's end here -------------------------

    def finished(self, request: FinishedRequest) -> None:
        e2e_ns = round(request.e2e * 1e9)
        if request.finish_reason == "abort":
            self.stats.failed(0, e2e_ns, FailureReason.CANCELED)
            return
        scheduled_ns = round(request.queue * 1e9)
        done_ns = scheduled_ns + round(request.inference * 1e9)
        times = ExecutionTimes(scheduled_ns, scheduled_ns, done_ns, done_ns)
        self.stats.executed(1, times)
        self.stats.succeeded(0, e2e_ns, 1, times)

    def failed(self, arrival: float, end: float, reason: FailureReason) -> None:
        self.stats.failed(0, round((end - arrival) * 1e9), reason)

    @asynccontextmanager
    async def generate(
        self, request: GenerationRequest
    ) -> AsyncIterator[AsyncIterator[GenerationChunk]]:
        """The request's chunks; leaving the block early aborts the request."""
        stream = _ChunkStream()
        try:
            record = await self.engine.add(request, stream)
        except trio.Cancelled:  # the requester left while its prompt was tokenized
            self.failed(request.arrival_time, trio.current_time(), FailureReason.CANCELED)
            raise
        try:
            yield stream
        finally:
            self.engine.abort(record)

    def admit(self) -> None:
        """The engine's own limits refuse later, once the prompt is known."""

    def submit(self, request: InferenceRequest) -> _CollectedTicket:
        """Queue an OIP request; its response arrives on the returned ticket. A task of
        the runner's admits it to the engine (tokenizing takes a worker thread)."""
        validate_request(self.model, request)
        generation = self._generation_request(request)
        if not self.engine.accepting or self._admissions is None:
            raise UnavailableError(f"model '{self.model.name}' is not ready")
        ticket = _CollectedTicket(self, request, generation.sampling.n)
        self._admissions.start_soon(self._admit, generation, ticket)
        return ticket

    async def _admit(self, generation: GenerationRequest, ticket: _CollectedTicket) -> None:
        if ticket.finished:  # withdrawn before this task began: nothing to generate
            self.failed(generation.arrival_time, trio.current_time(), FailureReason.CANCELED)
            return
        with ticket.admission:  # withdrawing the ticket cancels it
            try:
                ticket.record = await self.engine.add(generation, ticket)
            except InferenceServerError as exc:
                ticket.fail(exc)
            except trio.Cancelled:
                # Withdrawn by the requester: CANCELED; the runner stopping: OTHER.
                withdrawn = ticket.admission.cancel_called
                reason = FailureReason.CANCELED if withdrawn else FailureReason.OTHER
                self.failed(generation.arrival_time, trio.current_time(), reason)
                if not withdrawn:
                    ticket.fail(UnavailableError("server is shutting down"))
                raise

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        ticket = self.submit(request)
        try:
            await ticket.wait()
        except trio.Cancelled:
            ticket.withdraw()
            raise
        return ticket.outcome()

    def _generation_request(self, request: InferenceRequest) -> GenerationRequest:
        prompt, given = prompt_and_parameters(request.inputs, request.parameters)
        parameters = read_parameters(given, "vllm", max_num_seqs=self.max_num_seqs)
        generation = generation_request(
            self._ids.next("infer"), prompt, parameters, trio.current_time()
        )
        if request.trace is None:
            return generation
        return dataclasses.replace(generation, trace=request.trace)  # the engine's times
