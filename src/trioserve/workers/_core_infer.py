"""The INFERs of one front-end worker's link, in the core: an inference the worker
decoded costs no task. It is submitted as its frame is read
(``InferencePipeline.submit``; the alike ones of an INFERS together as one request
where their model allows, ``_coalesce.py``), its ticket notes it as finished
(``Ticket.when_finished``), and the inferences of one batch are answered in one ANSWER
frame as the batch ends (``Ticket.after_batch``), in the same turn of the event loop,
with the input blocks read meanwhile given back in one FREE. Where that cannot be done
at once (a write under way, a payload in a block, an inference that finished on its
own), one task (``LinkInferences.run``) answers every inference finished since its last
turn. A CANCEL withdraws an inference's ticket from its
model's queue: it finishes, and is not answered (the worker dropped it); one of a
coalesced request is only not answered, and the request is withdrawn once all of its
are. When the link closes, what it has in flight is withdrawn.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from .._context import ServerContext
from .._errors import ErrorKind, InferenceServerError
from .._pipeline import Submitted
from .._served import ServedModel
from .._tensor import DATATYPES, array_from_own_raw, array_to_raw
from .._types import (
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
)
from ..grpc import add_load_report
from ..ipc import Block, LinkClosed, SegmentMap
from ..metrics import FORMAT_HEADER
from ..rest import load_report_header
from ..scheduler import ModelRunner
from ._coalesce import Infers, each, inline_outputs, responses, rows_of, stacked
from ._wire import (
    ANSWER,
    FREE,
    INLINE_BYTES,
    NO_CALL,
    OUTCOME,
    Outbound,
    OutputPayload,
    Payload,
    Returned,
    WireTensor,
    address_of,
    inline_tensors,
    lies_in,
    on_loop_when_gone,
    read,
    root_in_place,
)

logger = logging.getLogger("trioserve.workers")

Tensor = tuple[str, str, tuple[int, ...], Payload, dict[str, Any]]


class LinkInferences:
    """The INFERs in flight on one worker's link."""

    def __init__(self, context: ServerContext, out: Outbound, peer: SegmentMap) -> None:
        self._context = context
        self._out = out
        self._peer = peer
        self._inferences: dict[int, _Inference | _Coalesced] = {}  # each INFER in flight
        self._finished: list[_Inference | _Coalesced] = []  # for ``run``'s next turn
        # Its next ANSWER's: (call, or the calls of an OUTCOME of several, item, last).
        self._outcomes: list[tuple[int | tuple[int, ...], tuple[Any, ...], bool]] = []
        self._outcome_blocks: list[OutputPayload] = []
        self._returned: list[Block] = []  # the inputs its outcomes' outputs lie in
        self._read: list[Block] = []  # input blocks done with, for its next FREE
        self._answerer: trio.lowlevel.Task | None = None  # while it waits for work
        self._off_loop: trio.Nursery | None = None  # answers written off the loop
        self._closed = False
        self._token = trio.lowlevel.current_trio_token()

    def withdraw(self, call: int) -> bool:
        """Withdraw the inference ``call`` (its client left); False if there is none in
        flight."""
        inference = self._inferences.get(call)
        if inference is None:
            return False
        if type(inference) is _Coalesced:
            del self._inferences[call]
            inference.withdraw(call)
        else:  # finished: not answered, inputs freed
            inference.submitted.ticket.withdraw()
        return True

    def submit_rows(self, message: Infers) -> None:
        """Submit the INFERs of an INFERS (alike ones, ``_coalesce.py``): as requests of
        at most a batch of their rows where their model stacks its batches' rows itself,
        else each on its own (``submit``), in order."""
        calls = message[1]
        runner = self._coalescing(message[3], message[4])
        step = max(_together(runner, message), 1) if runner is not None else len(calls)
        for start in range(0, len(calls), step):
            stop = min(start + step, len(calls))
            if runner is None or stop - start < 2 or not self._submit_coalesced(
                runner, message, start, stop
            ):  # fmt: skip
                for infer in each(message, start, stop):
                    self.submit(*infer[1:])

    def _coalescing(self, model: str, version: str) -> ModelRunner | None:
        """The runner that may take alike INFERs to ``model`` as one request, if any."""
        try:
            served = self._context.repository.get(model, version)
        except Exception:  # each is refused on its own
            return None
        return self._context.pipeline.coalescing(served)

    def _submit_coalesced(
        self, runner: ModelRunner, message: Infers, start: int, stop: int
    ) -> bool:
        """Submit INFERs ``start`` to ``stop`` of ``message`` as one request; False if
        it is refused (their shapes, the model unloading): each goes on its own then."""
        coalesced = _Coalesced(self, runner, message, start, stop)
        try:
            request = stacked(message, start, stop)
            coalesced.submitted = self._context.pipeline.submit_coalesced(
                runner, request, stop - start
            )
        except Exception:
            return False
        inferences = self._inferences
        for call in message[1][start:stop]:
            inferences[call] = coalesced
        coalesced.submitted.ticket.when_finished(coalesced.finished)
        return True

    def submit(
        self,
        call: int,
        endpoint: str,
        model: str,
        version: str,
        request_id: str,
        parameters: dict[str, Any],
        inputs: list[Tensor],
        outputs: list[tuple[str, dict[str, Any]]],
        report: tuple[str, Any] | None,
        trace_context: dict[Any, Any] | None,
    ) -> None:
        """Submit an inference the worker decoded (the pipeline reads its inputs in
        place); ``run`` answers it once its ticket has its outcome. One refused or
        failing here is answered in its next turn too."""
        asked = (request_id, parameters, outputs)
        inference = _Inference(self, call, model, version, inputs, asked, report)
        try:
            inference.served = served = self._context.repository.get(model, version)
            inference.submitted = self._context.pipeline.submit(
                served, inference.decode, endpoint=endpoint, headers=trace_context
            )
        except Exception as exc:  # before or after its inputs were read
            kept = inference.kept  # those the request's arrays read are freed as they go
            self._read += [p for *_, p, _ in inputs if type(p) is Block and p not in kept]
            self._add_failure(call, model, version, _error(exc))
            self._wake_answerer()
            return
        self._inferences[call] = inference
        inference.submitted.ticket.when_finished(inference.finished)

    def _wake_answerer(self) -> None:
        answerer = self._answerer
        if answerer is not None:
            self._answerer = None
            trio.lowlevel.reschedule(answerer)

    def _stop_waiting(self, _: object) -> trio.lowlevel.Abort:
        self._answerer = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def run(self) -> None:
        """Answer the inferences finished since the last turn, in one ANSWER frame
        (those of a batch finish together), and free the input blocks they read, until
        the link closes."""
        async with trio.open_nursery() as self._off_loop:
            while True:
                if not (self._finished or self._outcomes or self._read):
                    self._answerer = trio.lowlevel.current_task()
                    await trio.lowlevel.wait_task_rescheduled(self._stop_waiting)
                try:
                    await self._send_answers()
                except LinkClosed:
                    return  # the worker is gone; its link withdraws the rest

    async def _send_answers(self) -> None:
        await self._out.channel.flush()  # what ``_answer_now`` left to write
        self._answer_finished()
        blocks, self._outcome_blocks = self._outcome_blocks, []
        frames = self._take_frames()
        for frame in frames[:-1]:
            await self._out.send(frame)
        if frames:
            await self._out.send(frames[-1], *blocks)

    def _answer_now(self) -> None:
        """After a batch in which inferences of this link finished (in its runner's
        turn): answer them now, rather than wake ``run`` for a turn of its own, where the
        frame is written at once (its outputs all in it, no write under way)."""
        if self._answerer is None:  # woken already, or writing: it answers these too
            return
        try:  # (inside the runner: what goes wrong here is the link's alone)
            self._answer_finished()
            # Blocks of the core's arena may need announcing, with their descriptors.
            if not self._outcome_blocks:
                frames = self._take_frames()  # (none: every one withdrawn, or off the loop)
                if not frames or self._out.channel.write_now(frames):
                    return
        except LinkClosed:
            pass  # ``run`` finds it closed too, and ends
        except Exception:
            logger.exception("answering a worker's inferences failed")
        self._wake_answerer()

    def _take_frames(self) -> list[tuple[Any, ...]]:
        """The FREE of the input blocks read and the ANSWER of the outcomes, taken."""
        frames: list[tuple[Any, ...]] = []
        freed, self._read = self._read, []
        outcomes, self._outcomes = self._outcomes, []
        returned, self._returned = self._returned, []
        if freed:
            frames.append((FREE, freed))
        if returned:  # the worker keeps them for the answers, whenever they are freed
            frames.append((ANSWER, outcomes, returned))
        elif outcomes:
            frames.append((ANSWER, outcomes))
        return frames

    def _answer_finished(self) -> None:
        # A method of its own: nothing of these inferences stays in the frame of the
        # waiting task (a model may keep an input: its block is freed once let go).
        finished, self._finished = self._finished, []
        for inference in finished:
            if isinstance(inference, _Coalesced):
                self._answer_coalesced(inference)
            else:
                self._answer_inference(inference)

    def _answer_coalesced(self, coalesced: _Coalesced) -> None:
        """Answer the INFERs of a coalesced request that are not withdrawn: one OUTCOME
        of them all with the outputs' rows of all (the worker cuts each one's), each its
        rows on its own (outputs that do not ride in the frame), or the error."""
        message, start, stop = coalesced.message, coalesced.start, coalesced.stop
        calls, ids, report = message[1][start:stop], message[5][start:stop], message[9]
        withdrawn = coalesced.withdrawn
        answered = [call for call in calls if call not in withdrawn] if withdrawn else calls
        for call in answered:
            del self._inferences[call]
        try:
            response = coalesced.submitted.finish()
        except Exception as exc:
            error = _error(exc)
            for call in answered:
                self._add_failure(call, message[3], message[4], error)
            return
        if response is None:  # withdrawn: none is answered
            return
        runner, rows = coalesced.runner, rows_of(message)
        tensors = inline_outputs(response, stop - start, rows)
        if tensors is not None:  # the usual: small outputs, in the frame
            if withdrawn:  # their rows stay in the outputs, under no call
                calls = tuple([NO_CALL if call in withdrawn else call for call in calls])
            self._add_tensors(calls, response, ids, tensors, runner, report)
            return
        for call, own in zip(calls, responses(response, ids, rows), strict=True):
            if call not in withdrawn:
                try:  # packed in blocks: the arena may be full
                    self._add_outcome(call, own, runner, report, None)
                except Exception as exc:
                    self._add_failure(call, message[3], message[4], _error(exc))

    def _answer_inference(self, inference: _Inference) -> None:
        """Add a finished inference's answer to the next ANSWER (none if withdrawn: the
        worker dropped it), its input blocks to the next FREE."""
        del self._inferences[inference.call]
        submitted = inference.submitted
        if submitted.writes_off_loop:  # a device's outputs are copied in a thread
            assert self._off_loop is not None
            self._off_loop.start_soon(self._answer_off_loop, inference)
            return
        if inference.blocks:
            self._read_inputs(inference)
        try:
            if (response := submitted.finish()) is not None:
                self._add_answer(inference, response)
        except Exception as exc:
            self._add_failure(inference.call, inference.model, inference.version, _error(exc))

    async def _answer_off_loop(self, inference: _Inference) -> None:
        if inference.blocks:
            self._read_inputs(inference)
        try:
            if (response := await inference.submitted.finish_off_loop()) is not None:
                self._add_answer(inference, response)
        except Exception as exc:
            self._add_failure(inference.call, inference.model, inference.version, _error(exc))
        self._wake_answerer()

    def _add_answer(self, inference: _Inference, response: InferenceResponse) -> None:
        call, served, report = inference.call, inference.served, inference.report
        self._add_outcome(call, response, served, report, inference.kept)

    def _add_outcome(
        self,
        call: int,
        response: InferenceResponse,
        served: ServedModel,
        report: tuple[str, Any] | None,
        kept: dict[Block, int] | None,
    ) -> None:
        """Add an answered inference's OUTCOME to the next ANSWER (``kept``: its input
        blocks that a model array still reads, where it has any)."""
        outputs = response.outputs
        tensors = inline_tensors(outputs)
        if tensors is None:
            tensors = self._packed_tensors(kept, outputs)
        self._add_tensors(call, response, response.id, tensors, served, report)

    def _add_tensors(
        self,
        call: int | tuple[int, ...],
        response: InferenceResponse,
        request_id: str | tuple[str, ...],
        tensors: list[WireTensor[Any]],
        served: ServedModel,
        report: tuple[str, Any] | None,
    ) -> None:
        """Add the OUTCOME of ``response`` (its model, version and parameters) with
        ``tensors`` under ``request_id``, and the load report asked for, if any (the
        calls and ids of several INFERs whose rows ``tensors`` hold, in order)."""
        outcome = (
            OUTCOME, None, response.model_name, response.model_version, request_id,
            response.parameters, tensors,
            None if report is None else _load_report(self._context, served, report),
        )  # fmt: skip
        self._outcomes.append((call, outcome, True))

    def _add_failure(self, call: int, model: str, version: str, error: tuple[str, str]) -> None:
        outcome: tuple[Any, ...] = (OUTCOME, error, model, version, "", {}, [], None)
        self._outcomes.append((call, outcome, True))

    def _packed_tensors(
        self, kept: dict[Block, int] | None, outputs: list[OutputTensor]
    ) -> list[WireTensor[OutputPayload]]:
        """The outputs as an OUTCOME carries them where some output is large (it goes in
        a block, with the next ANSWER) or has to be converted. Packed all or none: a
        failure here (an output that cannot be encoded, a full arena) leaves no block
        behind that no OUTCOME names."""
        raws = [array_to_raw(t.data, t.datatype) for t in outputs]
        returned = _returned(raws, kept) if kept else None
        payloads = self._out.pack_all(raws, returned)
        self._outcome_blocks += [payload for payload in payloads if type(payload) is Block]
        if returned is not None:
            self._returned += [part.block for part in returned if part is not None]
        return [
            (tensor.name, tensor.datatype.name, tensor.shape, payload, tensor.parameters)
            for tensor, payload in zip(outputs, payloads, strict=True)
        ]

    def _read_inputs(self, inference: _Inference) -> None:
        """The worker may reuse the input blocks no model array still reads."""
        kept = inference.kept
        self._read += [block for block in inference.blocks if block not in kept]

    def abandon(self) -> None:
        """The link is gone: withdraw what it had in flight, and let go of what
        finished unanswered."""
        self._closed = True
        for inference in dict.fromkeys(self._inferences.values()):  # a coalesced one once
            inference.submitted.ticket.withdraw()
        for inference in self._finished:
            inference.submitted.abandon()
        self._inferences.clear()
        self._finished.clear()

    def _input_tensors(self, inference: _Inference) -> dict[str, InputTensor]:
        """The inputs as the model sees them: a large one reads the worker's block in
        place, which is freed once no array reads it (``kept``), however long the model
        keeps it: a model may keep an input beyond its request, as in one process."""
        tensors = {}
        for name, type_name, shape, payload, params in inference.inputs:
            dt = DATATYPES[type_name]  # the worker's name for it
            if type(payload) is bytes:  # the usual: small, in the frame, nobody's to free
                data = array_from_own_raw(dt, shape, payload)
            else:
                raw = read(payload, self._peer)
                data = array_from_own_raw(dt, shape, raw)
                if type(payload) is Block:
                    inference.blocks.append(payload)
                    if (root := root_in_place(data)) is not None:
                        # Once no array reads it (whichever thread drops the last one),
                        # the worker may reuse it.
                        on_loop_when_gone(root, self._token, self._free_kept, payload)
                        inference.kept[payload] = address_of(raw)
            tensors[name] = InputTensor(name, dt, shape, data, params)
        return tensors

    def _free_kept(self, block: Block) -> None:
        if not self._closed:  # else the link is gone, and the block with it
            self._read.append(block)
            self._wake_answerer()


class _InFlight:
    """A request in flight on the link, answered once its ticket has its outcome."""

    __slots__ = ("inferences", "submitted")

    inferences: LinkInferences
    submitted: Submitted

    def finished(self) -> None:
        """Its ticket has its outcome (called inside its model's runner): answered as
        its batch ends, else in ``run``'s next turn."""
        inferences = self.inferences
        inferences._finished.append(self)  # type: ignore[arg-type]  # a subclass
        if inferences._answerer is not None and not self.submitted.ticket.after_batch(
            inferences._answer_now
        ):
            inferences._wake_answerer()


class _Inference(_InFlight):
    """An INFER in flight: what its answer needs once its ticket has its outcome."""

    __slots__ = (
        "asked", "blocks", "call", "inputs", "kept", "model", "report", "served", "version"
    )  # fmt: skip

    served: ServedModel

    def __init__(
        self,
        inferences: LinkInferences,
        call: int,
        model: str,
        version: str,
        inputs: list[Tensor],
        asked: tuple[str, dict[str, Any], list[tuple[str, dict[str, Any]]]],
        report: tuple[str, Any] | None,
    ) -> None:
        self.inferences = inferences
        self.call = call
        self.model = model
        self.version = version
        self.inputs = inputs
        self.asked = asked  # the request's id, parameters and requested outputs
        # Input blocks freed once the model lets go of them, with where they start here.
        self.kept: dict[Block, int] = {}
        self.blocks: list[Block] = []  # its inputs' blocks, once read: the worker's to reuse
        self.report = report

    def decode(self, regions: object) -> InferenceRequest:
        """The request the pipeline queues (a method rather than a closure, which would
        make a function and its cells for every request)."""
        request_id, parameters, outputs = self.asked
        return InferenceRequest(
            self.model, self.version, self.inferences._input_tensors(self),
            [RequestedOutput(name, params) for name, params in outputs] if outputs else [],
            request_id, parameters,
        )  # fmt: skip


class _Coalesced(_InFlight):
    """INFERs ``start`` to ``stop`` of an INFERS in flight as one request."""

    __slots__ = ("message", "runner", "start", "stop", "withdrawn")

    def __init__(
        self,
        inferences: LinkInferences,
        runner: ModelRunner,
        message: Infers,
        start: int,
        stop: int,
    ) -> None:
        self.inferences = inferences
        self.runner = runner
        self.message = message
        self.start = start
        self.stop = stop
        self.withdrawn: set[int] = set()  # the calls not to answer (their clients left)

    def withdraw(self, call: int) -> None:
        """INFER ``call`` is not answered; the request is withdrawn once none is."""
        self.withdrawn.add(call)
        if len(self.withdrawn) == self.stop - self.start:
            self.submitted.ticket.withdraw()


def _together(runner: ModelRunner, message: Infers) -> int:
    """How many INFERs of an INFERS go in one request: as many rows as the model's
    largest preferred batch size holds, or its max batch size (0 or 1: each goes alone,
    and one too large is refused as it would be alone)."""
    policy = runner.policy
    return max(policy.preferred_batch_sizes, default=policy.max_batch_size) // rows_of(message)


def _returned(
    raws: list[bytes | memoryview], kept: dict[Block, int]
) -> list[Returned | None] | None:
    """Where a large output lies in one of its inference's input blocks (a model that
    answers with its input, or a slice of it), the part of it that it is: not copied
    into the core's arena, the worker reads it where it wrote it. None if none does."""
    parts: list[Returned | None] = []
    for raw in raws:
        found = lies_in(raw, kept) if len(raw) >= INLINE_BYTES else None
        parts.append(None if found is None else Returned(found[0], found[1], len(raw)))
    return parts if any(parts) else None


def _error(exc: Exception) -> tuple[str, str]:
    """A failed inference's (kind, message); anything but an ``InferenceServerError`` is
    a bug of ours, logged and answered INTERNAL (the link and its other calls go on)."""
    if isinstance(exc, InferenceServerError):
        return exc.kind.name, exc.message
    logger.exception("a forwarded inference failed")
    return ErrorKind.INTERNAL.name, f"internal error: {exc!r}"


def _load_report(context: ServerContext, served: ServedModel, asked: tuple[str, Any]) -> Any:
    """The load report an INFER asked for: REST's header, or gRPC's trailers."""
    transport, wanted = asked
    if transport == "http":
        return load_report_header(context.load, served, {FORMAT_HEADER: wanted})
    call = ForwardedCall({FORMAT_HEADER.decode(): wanted})
    add_load_report(call, context.load, served)
    return call.trailers


class ForwardedCall:
    """What a handler sees of a call a worker forwarded (``grpc._call.Call``); an
    INFER's load report is added to one too (gRPC's trailers)."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self.metadata = metadata
        self.trailers: list[tuple[str, bytes]] = []

    def add_trailer(self, key: str, value: bytes) -> None:
        self.trailers.append((key, value))

    def cancel_with(self, withdraw: object) -> None:
        pass  # a forwarded call runs under a cancel scope, which a CANCEL cancels
