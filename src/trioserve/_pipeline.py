"""One inference request from its decoded message to its outcome, for every front end.

REST infer, gRPC ModelInfer and ModelStreamInfer's tensor requests and in-process
``Server.infer`` all run here, so a change to shared memory, device copies or load
counting is made once:

1. refuse a decoupled model on a unary ``endpoint`` (Triton's message names it);
2. lease the shared-memory regions the request names, while the front end's ``decode``
   turns its wire message into an ``InferenceRequest`` (wire formats differ, the rest
   does not);
3. read inputs waiting on a device (CUDA regions) or in a large system window, in a
   worker thread;
4. count the request toward the server's load from here, its arrival at the model: it
   counts once its outcome is known (an error too; a cancellation or a withdrawal not);
5. submit it and wait for its ticket: a cancelled wait withdraws the request from the
   model's queue;
6. write its outputs placed in shared memory (in a worker thread for a device or a large
   window), or copy a device's outputs to the host;
7. release the regions.

``infer`` and ``infer_decoupled`` share these steps (``_admit``, ``_arrived``, ``_write``,
``_release``). The front end then encodes the response and adds its load report (REST's
header, gRPC's trailer; both built by ``LoadReporter.report``).

A decoupled model's request takes ``infer_decoupled`` instead, on streams only: each
of its answers goes to the front end's ``deliver`` as it comes.

A front end may also pass a ``Watch``: the watch tracks the ticket while it waits and
may withdraw it (REST's and gRPC's do when the client disconnects), in which case
``infer`` returns None: there is nobody left to answer.

A front end that handles many requests in one task (the core's end of a front-end
worker's link, whose frames carry several inferences) takes the same steps apart instead:
``submit`` runs steps 1, 2, 4 and 5's submission at once and returns a ``Submitted``,
whose ticket calls back when its outcome is known (``Ticket.when_finished``); then
``Submitted.finish`` runs 6 and 7. No task, coroutine or cancel scope per request: the
front end withdraws the ticket itself. Its ``decode`` must lease no regions to read
off the loop (step 3), as the worker's decoded inferences carry their tensors.

When the server traces (``tracing``), ``infer`` asks its ``TraceControl`` whether this
request is traced, before decoding it: a traced request carries its ``Trace``, which the
runner stamps with its queue and compute times, and which ends here once the outputs
are written. A server that traces nothing reads one attribute per request for it.

Generations stream chunks from the engine: every front end (REST generate and
generate_stream, OpenAI completions and chat, gRPC ModelStreamInfer, in-process
``Server.generate``) builds its ``GenerationRequest`` with ``generation_request`` (the
server's request id from its one ``RequestIds``, the arrival stamped now, the trace
sampled) and runs it in ``generate``, which counts it toward the load as step 4 does.
An OIP inference of a generative model takes ``infer`` like any other; its runner draws
the engine's id from the same ``RequestIds``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Generic, Protocol, TypeVar, overload

import trio

from ._errors import InferenceServerError, UnsupportedError
from ._served import Answer, ServedModel, Ticket
from ._types import InferenceRequest, InferenceResponse
from .metrics import Counting, LoadReporter
from .scheduler import (
    GenerationChunk,
    GenerationRequest,
    GenerativeServed,
    ModelRunner,
    RequestIds,
    RequestParameters,
    generation_request,
)
from .shm import RequestRegions, SharedMemoryRegistry
from .tracing import Trace, TraceControl

Decode = Callable[[RequestRegions], InferenceRequest]
"""The front end's decoding of its message, leasing the regions it names."""

_Client = TypeVar("_Client", contravariant=True)
_Token = TypeVar("_Token")


class Watch(Protocol, Generic[_Client, _Token]):
    """Something that watches a waiting ticket for its client (and may withdraw it)."""

    def track(self, ticket: Ticket, client: _Client, /) -> _Token: ...

    def untrack(self, ticket: Ticket, token: _Token, /) -> None: ...


class InferencePipeline:
    """A server instance's inference path; its front ends share one."""

    __slots__ = ("_ids", "_load", "_shared_memory", "_tracing")

    def __init__(
        self,
        shared_memory: SharedMemoryRegistry,
        load: LoadReporter,
        tracing: TraceControl,
        request_ids: RequestIds,
    ) -> None:
        self._shared_memory = shared_memory
        self._load = load
        self._tracing = tracing
        self._ids = request_ids  # the generative runners draw from the same

    def generation_request(
        self,
        origin: str,
        served: GenerativeServed,
        prompt: object,
        parameters: RequestParameters,
        headers: Mapping[Any, Any],
        *,
        prompt_token_ids: tuple[int, ...] | None = None,
    ) -> GenerationRequest:
        """The engine's request for ``prompt`` to ``served``, arriving now, with the
        server's next request id (``origin`` names the front end, for logs), traced if
        the server traces it (``headers``: the request's, for a client's trace context;
        the engine ends the trace). ``prompt_token_ids``: the prompt already tokenized."""
        generation = generation_request(
            self._ids.next(origin), prompt, parameters, trio.current_time()
        )
        if prompt_token_ids is not None:
            generation = dataclasses.replace(generation, prompt_token_ids=prompt_token_ids)
        if not self._tracing.active:
            return generation
        trace = self._sample(served, headers)
        if trace is None:
            return generation
        trace.request_id = generation.request_id
        return dataclasses.replace(generation, trace=trace)

    @asynccontextmanager
    async def generate(
        self, served: GenerativeServed, generation: GenerationRequest
    ) -> AsyncIterator[AsyncIterator[GenerationChunk]]:
        """The chunks of ``generation`` (``generation_request``'s); leaving the block
        early aborts it. The generation counts toward the load once the block ends: an
        error raised in it as a failure, a cancellation (the client left) not at all."""
        with self._load.counting(served):
            async with served.generate(generation) as chunks:
                yield chunks

    @overload
    async def infer(
        self,
        served: ServedModel,
        decode: Decode,
        *,
        endpoint: str,
        submitted: Callable[[], object] | None = None,
        large: bool = False,
        headers: Mapping[Any, Any] | None = None,
    ) -> tuple[InferenceRequest, InferenceResponse]: ...

    @overload
    async def infer(
        self,
        served: ServedModel,
        decode: Decode,
        watch: Watch[_Client, _Token],
        client: _Client,
        *,
        endpoint: str,
        large: bool = False,
        headers: Mapping[Any, Any] | None = None,
    ) -> tuple[InferenceRequest, InferenceResponse] | None: ...

    async def infer(
        self,
        served: ServedModel,
        decode: Decode,
        watch: Watch[Any, Any] | None = None,
        client: Any = None,
        *,
        endpoint: str,
        submitted: Callable[[], object] | None = None,
        large: bool = False,
        headers: Mapping[Any, Any] | None = None,
    ) -> tuple[InferenceRequest, InferenceResponse] | None:
        """The request ``decode`` gives and its response; None if ``watch`` withdrew it.
        ``endpoint`` names the front end's call in the refusal of a decoupled model,
        which it cannot answer. ``submitted`` is called once the request is in its
        model's queue (a stream of a sequence model submits its requests in order).
        ``large``: the message is big enough (``OFF_LOOP_BYTES``) to decode in a worker
        thread. ``headers``: the request's (HTTP headers or gRPC metadata), read only if
        it is traced.

        One coroutine from the decode to the outcome: every frame between the front end
        and the ticket's wait is resumed again when the outcome arrives.
        """
        if served.model.decoupled:
            raise UnsupportedError(
                f"{endpoint} doesn't support models with decoupled transaction policy"
            )
        regions, trace = self._admit(served, headers)
        try:
            request = await _decode_in_thread(decode, regions) if large else decode(regions)
            # The usual request is neither traced nor read off the loop: no call for it.
            if (trace is not None or regions.inputs_off_loop) and (
                reading := _arrived(request, regions, trace)
            ):
                await reading
            with self._load.counting(served) as counting:
                ticket = served.submit(request)
                if submitted is not None:
                    submitted()
                token = None if watch is None else watch.track(ticket, client)
                try:
                    await ticket.wait()
                except trio.Cancelled:
                    ticket.withdraw()
                    raise
                finally:
                    if watch is not None:
                        watch.untrack(ticket, token)
                if watch is not None and ticket.withdrawn:
                    counting.uncounted()
                    return None
                response = ticket.outcome()
                # The usual request has nothing traced nor placed: no call for it either.
                if (trace is not None or regions.outputs_placed or regions.outputs_off_loop) and (
                    writing := _write(regions, response, trace)
                ):
                    await writing
        finally:
            _release(regions, trace)
        return request, response

    def submit(
        self,
        served: ServedModel,
        decode: Decode,
        *,
        endpoint: str,
        headers: Mapping[Any, Any] | None = None,
    ) -> Submitted:
        """Admit, decode and queue the request ``decode`` gives, as ``infer`` does, in
        one synchronous step; its outcome comes through ``Submitted``. A refusal, a
        failed decode or submission raises here (counted as ``infer`` counts them)."""
        if served.model.decoupled:
            raise UnsupportedError(
                f"{endpoint} doesn't support models with decoupled transaction policy"
            )
        regions, trace = self._admit(served, headers)
        try:
            request = decode(regions)
            if trace is not None:
                _arrived(request, regions, trace)
            assert not regions.inputs_off_loop, "submit() reads no inputs off the loop"
            counting = self._load.counting(served)
            try:
                ticket = served.submit(request)
            except Exception:
                with counting:  # a refusal counts as a failure, as in ``infer``
                    raise
        except BaseException:
            _release(regions, trace)
            raise
        return Submitted(ticket, regions, trace, counting)

    def coalescing(self, served: ServedModel) -> ModelRunner | None:
        """``served``'s runner if like requests to it may now be submitted as one
        (``submit_coalesced``): it ``coalesces``, and no request is traced (each traced
        request has a trace of its own), else None."""
        if isinstance(served, ModelRunner) and served.coalesces and not self._tracing.active:
            return served
        return None

    def submit_coalesced(
        self, runner: ModelRunner, request: InferenceRequest, requests: int
    ) -> Submitted:
        """Queue ``request``, which stacks the rows of ``requests`` alike requests whose
        inputs came in the message (no region to lease), as ``submit`` queues one; each of
        them counts in the load and statistics. A refusal raises uncounted: the caller
        submits them one by one, and each is refused (and counted) with its own shapes."""
        ticket = runner.submit_coalesced(request, requests)
        counting = self._load.counting(runner, requests)
        regions = RequestRegions(self._shared_memory, runner.model.device, False)
        return Submitted(ticket, regions, None, counting)

    async def infer_decoupled(
        self,
        served: ServedModel,
        decode: Decode,
        deliver: Callable[[Answer, bool], Awaitable[None]],
        *,
        headers: Mapping[Any, Any] | None = None,
    ) -> None:
        """Submit the request ``decode`` gives to a decoupled model and ``deliver`` each
        of its answers with its final flag, the last one final. Cancelling this
        withdraws the request (the model sees it cancelled). A traced request's trace
        holds every response's outputs, and ends with the last."""
        regions, trace = self._admit(served, headers)
        try:
            request = decode(regions)
            if reading := _arrived(request, regions, trace):
                await reading
            with self._load.counting(served) as counting:
                ticket = served.submit(request)
                answers = ticket.answers()
                assert answers is not None, "a decoupled model's ticket has answers"
                try:
                    async for answer, final in answers:
                        if isinstance(answer, InferenceResponse) and (
                            writing := _write(regions, answer, trace)
                        ):
                            await writing
                        await deliver(answer, final)
                except trio.Cancelled:
                    ticket.withdraw()
                    raise
                if ticket.finished:
                    try:
                        ticket.outcome()
                    except InferenceServerError:
                        counting.failed()  # already answered to the client
        finally:
            _release(regions, trace)

    def _admit(
        self, served: ServedModel, headers: Mapping[Any, Any] | None
    ) -> tuple[RequestRegions, Trace | None]:
        """Admit a request to ``served`` (a full queue refuses it before it is decoded):
        the regions its decode leases and its trace, if it is traced; ``_release``
        gives them back."""
        served.admit()
        trace = self._sample(served, headers) if self._tracing.active else None
        # A traced request's trace records its inputs' bytes: they are read here then.
        windows = trace is None and served.model.reads_client_windows
        return RequestRegions(self._shared_memory, served.model.device, windows), trace

    def _sample(self, served: ServedModel, headers: Mapping[Any, Any] | None) -> Trace | None:
        return self._tracing.sample(served.model.name, served.version, headers)


class Submitted:
    """An inference queued by ``InferencePipeline.submit``: once its ``ticket`` has its
    outcome, ``finish`` (or ``finish_off_loop`` where ``writes_off_loop``) ends it."""

    __slots__ = ("_counting", "_regions", "_trace", "ticket", "writes_off_loop")

    def __init__(
        self, ticket: Ticket, regions: RequestRegions, trace: Trace | None, counting: Counting
    ) -> None:
        self.ticket = ticket
        self._regions = regions
        self._trace = trace
        self._counting = counting
        # Its outputs are written off the loop (a device's): ``finish_off_loop``. Known
        # once the request is decoded; an attribute, not a property, as it is asked of
        # every request.
        self.writes_off_loop = regions.outputs_off_loop

    def finish(self) -> InferenceResponse | None:
        """The response, None if the ticket was withdrawn, or the request's error raised;
        the request is counted toward the load, its regions released, its trace ended."""
        try:
            with self._counting as counting:
                response = self._outcome(counting)
                # As in ``infer``, no call for the usual response: nothing traced or placed.
                if response is not None and (
                    self._trace is not None or self._regions.outputs_placed
                ):
                    _write(self._regions, response, self._trace)  # on the loop: None
        finally:
            _release(self._regions, self._trace)
        return response

    async def finish_off_loop(self) -> InferenceResponse | None:
        """``finish`` for outputs written off the loop (``writes_off_loop``)."""
        try:
            with self._counting as counting:
                response = self._outcome(counting)
                if response is not None and (
                    writing := _write(self._regions, response, self._trace)
                ):
                    await writing
        finally:
            _release(self._regions, self._trace)
        return response

    def abandon(self) -> None:
        """Nobody will read the outcome (the front end is gone): the request is left out
        of the load, its regions are released and its trace ended."""
        _release(self._regions, self._trace)

    def _outcome(self, counting: Counting) -> InferenceResponse | None:
        if self.ticket.withdrawn:
            counting.uncounted()  # nobody waits for it
            return None
        return self.ticket.outcome()


# The steps around the wait are plain functions that hand back what is left to await, if
# anything: most requests have nothing to read or write off the loop, and a coroutine
# per step cost the paired benchmark's small requests 1.5% more CPU.


def _arrived(
    request: InferenceRequest, regions: RequestRegions, trace: Trace | None
) -> Awaitable[None] | None:
    """A decoded request, traced if it is; the read of its inputs that wait off the loop
    (a device, a large window), to await, if it has any."""
    if trace is not None:
        trace.request_id = request.id
        trace.inputs(request.inputs.values())
        trace.ended_by_request = True
        request.trace = trace  # the runner stamps it
    return regions.read_inputs_off_loop() if regions.inputs_off_loop else None


def _write(
    regions: RequestRegions, response: InferenceResponse, trace: Trace | None
) -> Awaitable[None] | None:
    """``response``'s outputs recorded by the trace and written where the request placed
    them in shared memory; the write off the loop (a device, a large window), to await,
    if there is one."""
    if trace is not None:
        trace.outputs(response.outputs)
    if regions.outputs_off_loop:
        return regions.write_outputs_off_loop(response)
    if regions.outputs_placed:
        regions.write_outputs(response)
    return None


def _release(regions: RequestRegions, trace: Trace | None) -> None:
    regions.close()
    if trace is not None:  # a failed request's trace too, as Triton's
        trace.end()


async def _decode_in_thread(decode: Decode, regions: RequestRegions) -> InferenceRequest:
    """Decode a large message in a worker thread, so that no other client waits for it
    (a 40 MiB JSON body takes a second or more); the regions it names are still leased
    on the event loop, which alone touches the registry."""
    regions.leasing_from_thread = True
    try:
        return await trio.to_thread.run_sync(decode, regions)
    finally:
        regions.leasing_from_thread = False
