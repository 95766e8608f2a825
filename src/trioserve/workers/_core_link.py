"""The core process's end of one front-end worker's link: it runs each forwarded call
through the same code a single process runs (the REST app, the gRPC method table), so
every connection, whichever worker took it, gets the same answer.

An INFER (an inference the worker decoded) costs no task: it is submitted as its frame
is read (``InferencePipeline.submit``), its ticket notes it as finished, and one task,
``_answer_inferences``, answers every inference finished since its last turn in one
ANSWER frame (the input blocks read meanwhile go back in one FREE). Every other call
runs in a task of its own. A CANCEL from the worker (its client left) withdraws it, as
a client's disconnect does in one process: an INFER's ticket is withdrawn from its
model's queue, any other call's cancel scope is cancelled. When the link dies (the
worker exited), every call of that worker is withdrawn or cancelled; other workers'
calls go on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import trio

from .._context import ServerContext
from .._errors import ErrorKind, InferenceServerError
from .._pipeline import Submitted
from .._served import ServedModel
from .._tensor import array_from_raw, array_to_raw, datatype
from .._types import InferenceRequest, InferenceResponse, InputTensor, RequestedOutput
from ..grpc import (
    ClientGone,
    GrpcError,
    GrpcStatus,
    Method,
    StreamMethod,
    UnaryMethod,
    WireReply,
    add_load_report,
    parse_message,
    status_of,
)
from ..ipc import Block, LinkClosed, Replies, SegmentMap, TrioChannel
from ..metrics import FORMAT_HEADER
from ..rest import RestApp, load_report_header
from ._wire import (
    ANSWER,
    BODY,
    CANCEL,
    COUNTERS,
    END,
    FREE,
    GRPC,
    GRPC_STREAM,
    HALF_CLOSE,
    HTTP,
    INFER,
    MESSAGE,
    OUTCOME,
    PULL,
    REPLY,
    START,
    Outbound,
    Payload,
    new_arena,
    read,
    unwrap,
)

logger = logging.getLogger("trioserve.workers")

Snapshot = dict[str, dict[str, int]]  # counter group ("http", "grpc", "worker") -> counts


class WorkerLink:
    """Serves one worker's calls until its link closes."""

    def __init__(
        self,
        channel: TrioChannel,
        context: ServerContext,
        rest_app: RestApp,
        grpc_methods: Mapping[str, Method],
    ) -> None:
        self.channel = channel
        self._context = context
        self.out = Outbound(channel, new_arena())
        self.peer = SegmentMap()
        self._rest_app = rest_app
        self._grpc_methods = grpc_methods
        self._calls: dict[int, trio.CancelScope] = {}
        self._inferences: dict[int, _Inference] = {}  # each INFER in flight
        self._finished: list[_Inference] = []  # for ``_answer_inferences``' next turn
        self._outcomes: list[tuple[int, tuple[Any, ...], bool]] = []  # its next ANSWER's
        self._outcome_blocks: list[Payload] = []
        self._read: list[Block] = []  # input blocks done with, for its next FREE
        self._answerer: trio.lowlevel.Task | None = None  # while it waits for work
        self._streams: dict[int, trio.MemorySendChannel[Payload]] = {}
        self._pulls: Replies[Snapshot] = Replies()
        self._answers: list[tuple[int, tuple[Any, ...], bool]] = []  # for the next ANSWER
        self._answer_payloads: list[object] = []  # theirs that may be blocks
        self._nursery: trio.Nursery | None = None  # while serving: for finalizers' FREEs
        self._token = trio.lowlevel.current_trio_token()

    async def serve(self, frames: list[tuple[Any, list[int]]]) -> None:
        """Answer calls until the worker closes the link; ``frames``: received already."""
        try:
            async with trio.open_nursery() as calls:
                self._nursery = calls
                calls.start_soon(self._answer_inferences)
                try:
                    while True:
                        for message, fds in frames:
                            self._dispatch(calls, unwrap(message, fds, self.peer))
                        frames = await self.channel.receive()
                except LinkClosed:
                    calls.cancel_scope.cancel()  # the worker's clients are gone with it
        finally:
            self._nursery = None
            self._abandon_inferences()
            self._pulls.fail_all(LinkClosed("the worker exited"))
            self.channel.close()
            self.peer.close()
            self.out.arena.close()

    async def counters(self) -> Snapshot:
        """The worker's counters now (raises ``LinkClosed`` if it is gone)."""
        pull, answers = self._pulls.open()
        try:
            await self.out.send((PULL, pull))
            answer = await answers.receive()
        finally:
            self._pulls.withdraw(pull)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _dispatch(self, calls: trio.Nursery, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == INFER:
            self._infer(*message[1:])
        elif kind == HTTP:
            calls.start_soon(self._http, *message[1:])
        elif kind == GRPC:
            calls.start_soon(self._grpc_unary, *message[1:])
        elif kind == GRPC_STREAM:
            send, receive = trio.open_memory_channel[Payload](math.inf)
            self._streams[message[1]] = send
            _, call, path, metadata = message
            calls.start_soon(self._grpc_stream, call, path, metadata, receive)
        elif kind == MESSAGE:
            stream = self._streams.get(message[1])
            if stream is not None:
                stream.send_nowait(message[2])
        elif kind == HALF_CLOSE:
            stream = self._streams.pop(message[1], None)
            if stream is not None:
                stream.close()
        elif kind == CANCEL:
            self._cancel(message[1])
        elif kind == FREE:
            for block in message[1]:
                self.out.arena.free(block)
        elif kind == COUNTERS:
            self._pulls.deliver(message[1], message[2])
        else:
            logger.error("a worker sent an unknown message kind %r", kind)

    def _cancel(self, call: int) -> None:
        scope = self._calls.get(call)
        if scope is not None:
            scope.cancel()
        elif (inference := self._inferences.get(call)) is not None:
            inference.submitted.ticket.withdraw()  # finished: not answered, inputs freed

    async def _answer(
        self, call: int, item: tuple[Any, ...], last: bool, *payloads: object
    ) -> None:
        """Answers given in one turn of the event loop (a batch's requests finish
        together) go in one frame: the first waits for the turn's others, then sends."""
        self._answers.append((call, item, last))
        self._answer_payloads += payloads
        if len(self._answers) > 1:
            return
        await trio.lowlevel.cancel_shielded_checkpoint()
        answers, self._answers = self._answers, []
        blocks, self._answer_payloads = self._answer_payloads, []
        # (Not contextlib.suppress: an object per frame, on the path of every request.)
        try:
            await self.out.send((ANSWER, answers), *blocks)
        except LinkClosed:
            return  # the worker is gone; serve() cancels the rest

    async def _release(self, *payloads: Payload) -> None:
        """The worker's blocks, read: it may reuse them. (The send is shielded: this runs
        in the ``finally`` of cancelled calls too.)"""
        blocks = [payload for payload in payloads if isinstance(payload, Block)]
        if blocks:
            try:
                await self.out.send((FREE, blocks))
            except LinkClosed:
                return

    def _infer(
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
        place); ``_answer_inferences`` answers it once its ticket has its outcome. One
        refused or failing here is answered in that task's next turn too."""
        inference = _Inference(self, call, model, version, inputs, report)

        def decode(regions: object) -> InferenceRequest:
            return InferenceRequest(
                model, version, self._input_tensors(inputs, inference.kept),
                [RequestedOutput(name, params) for name, params in outputs],
                request_id, parameters,
            )  # fmt: skip

        try:
            inference.served = served = self._context.repository.get(model, version)
            inference.submitted = self._context.pipeline.submit(
                served, decode, endpoint=endpoint, headers=trace_context
            )
        except Exception as exc:
            self._read_inputs(inference)
            self._add_failure(inference, exc)
            self._wake_answerer()
            return
        self._inferences[call] = inference
        inference.submitted.ticket.when_finished(inference.finished)

    def _finished_inference(self, inference: _Inference) -> None:
        """``inference``'s ticket has its outcome (called inside its model's runner)."""
        self._finished.append(inference)
        self._wake_answerer()

    def _wake_answerer(self) -> None:
        answerer = self._answerer
        if answerer is not None:
            self._answerer = None
            trio.lowlevel.reschedule(answerer)

    def _stop_waiting(self, _: object) -> trio.lowlevel.Abort:
        self._answerer = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _answer_inferences(self) -> None:
        """Answer the inferences finished since the last turn, in one ANSWER frame
        (those of a batch finish together), and free the input blocks they read."""
        while True:
            if not (self._finished or self._outcomes):
                self._answerer = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._stop_waiting)
            try:
                await self._send_answers()
            except LinkClosed:
                return  # the worker is gone; serve() withdraws the rest

    async def _send_answers(self) -> None:
        self._answer_finished()
        read, self._read = self._read, []
        outcomes, self._outcomes = self._outcomes, []
        blocks, self._outcome_blocks = self._outcome_blocks, []
        if read:
            await self.out.send((FREE, read))
        if outcomes:
            await self.out.send((ANSWER, outcomes), *blocks)

    def _answer_finished(self) -> None:
        # A method of its own: nothing of these inferences stays in the frame of the
        # waiting task (a model may keep an input: its block is freed once let go).
        finished, self._finished = self._finished, []
        for inference in finished:
            self._answer_inference(inference)

    def _answer_inference(self, inference: _Inference) -> None:
        """Add a finished inference's answer to the next ANSWER (none if withdrawn: the
        worker dropped it), its input blocks to the next FREE."""
        del self._inferences[inference.call]
        submitted = inference.submitted
        if submitted.writes_off_loop:  # a device's outputs are copied in a thread
            assert self._nursery is not None
            self._nursery.start_soon(self._answer_off_loop, inference)
            return
        self._read_inputs(inference)
        try:
            self._add_outcome(inference, submitted.finish())
        except Exception as exc:
            self._add_failure(inference, exc)

    async def _answer_off_loop(self, inference: _Inference) -> None:
        self._read_inputs(inference)
        try:
            self._add_outcome(inference, await inference.submitted.finish_off_loop())
        except Exception as exc:
            self._add_failure(inference, exc)
        self._wake_answerer()

    def _add_outcome(self, inference: _Inference, response: InferenceResponse | None) -> None:
        if response is not None:
            self._outcomes.append((inference.call, self._outcome(inference, response), True))

    def _add_failure(self, inference: _Inference, exc: Exception) -> None:
        outcome: tuple[Any, ...] = (
            OUTCOME, _error(exc), inference.model, inference.version, "", {}, [], None
        )  # fmt: skip
        self._outcomes.append((inference.call, outcome, True))

    def _outcome(self, inference: _Inference, response: InferenceResponse) -> tuple[Any, ...]:
        """An answered inference's OUTCOME; its output blocks go with the next ANSWER."""
        tensors = []
        for tensor in response.outputs:
            payload = self.out.pack(array_to_raw(tensor.data, tensor.datatype))
            self._outcome_blocks.append(payload)
            tensors.append(
                (tensor.name, tensor.datatype.name, tensor.shape, payload, tensor.parameters)
            )
        report = _load_report(self._context, inference.served, inference.report)
        return (
            OUTCOME, None, response.model_name, response.model_version, response.id,
            response.parameters, tensors, report,
        )  # fmt: skip

    def _read_inputs(self, inference: _Inference) -> None:
        """The worker may reuse the input blocks no model array still reads."""
        kept = inference.kept
        for given in inference.inputs:
            payload = given[3]
            if isinstance(payload, Block) and payload not in kept:
                self._read.append(payload)

    def _abandon_inferences(self) -> None:
        """The link is gone: withdraw what it had in flight, and let go of what
        finished unanswered."""
        for inference in list(self._inferences.values()):
            inference.submitted.ticket.withdraw()
        for inference in self._finished:
            inference.submitted.abandon()
        self._inferences.clear()
        self._finished.clear()

    def _input_tensors(self, inputs: list[Tensor], kept: list[Block]) -> dict[str, InputTensor]:
        """The inputs as the model sees them: a large one reads the worker's block in
        place, which is freed once no array reads it (``kept``), however long the model
        keeps it: a model may keep an input beyond its request, as in one process."""
        tensors = {}
        for name, type_name, shape, payload, params in inputs:
            dt = datatype(type_name)
            data = array_from_raw(dt, shape, read(payload, self.peer), f"input '{name}'")
            if isinstance(payload, Block):
                root = data  # the array every view of the block leads back to
                while isinstance(root.base, np.ndarray):
                    root = root.base
                if isinstance(root.base, memoryview):  # not a copy (BYTES are decoded)
                    weakref.finalize(root, self._let_go, payload).atexit = False
                    kept.append(payload)
            tensors[name] = InputTensor(name, dt, shape, data, params)
        return tensors

    def _let_go(self, block: Block) -> None:
        """No array reads an input's ``block`` any more (in whichever thread dropped the
        last one): the worker may reuse it."""
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._free_kept, block)

    def _free_kept(self, block: Block) -> None:
        if self._nursery is not None:  # else the link is gone, and the block with it
            self._nursery.start_soon(self._release, block)

    async def _http(
        self,
        call: int,
        method: str,
        path: str,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        body: Payload,
    ) -> None:
        # The body is handed to the app once and not kept here: once the app is done,
        # nothing of this process reads the worker's block, which it may then reuse.
        unread = [read(body, self.peer)]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method, "path": path, "raw_path": path.encode(), "query_string": query,
            "headers": headers, "scheme": "http",
        }  # fmt: skip

        async def receive() -> dict[str, Any]:
            if unread:
                return {"type": "http.request", "body": unread.pop(), "more_body": False}
            await trio.sleep_forever()  # cancelled when the worker's client leaves
            raise AssertionError("unreachable")

        start: tuple[Any, ...] | None = None
        answered: list[bool] = []  # something went to the client

        async def send(message: Mapping[str, Any]) -> None:
            # The head waits for the first body chunk: one frame for a whole response.
            nonlocal start
            if message["type"] == "http.response.start":
                start = (START, message["status"], list(message.get("headers", ())))
            elif message["type"] == "http.response.body":
                more = message.get("more_body", False)
                chunk = self.out.pack(message.get("body", b""))
                item = (BODY, chunk, more) if start is None else (*start, chunk, more)
                start = None
                answered.append(True)
                await self._answer(call, item, not more, chunk)

        with trio.CancelScope() as cancel:
            self._calls[call] = cancel
            try:
                await self._rest_app(scope, receive, send)
            except Exception:  # a bug of ours: answered 500, the link goes on
                logger.exception("a forwarded HTTP request failed")
                if start is not None or not answered:
                    item = (START, 500, [(b"content-type", b"application/json")])
                    await self._answer(call, (*item, b'{"error":"internal error"}', False), True)
            finally:
                del self._calls[call]
                await self._release(body)

    async def _grpc_unary(
        self, call: int, path: str, metadata: dict[str, str], message: Payload
    ) -> None:
        method = self._grpc_methods.get(path)
        forwarded = _ForwardedCall(metadata)
        reply: Payload = b""
        with trio.CancelScope() as cancel:
            self._calls[call] = cancel
            try:
                if not isinstance(method, UnaryMethod):
                    raise GrpcError(GrpcStatus.UNIMPLEMENTED, f"unknown method {path}")
                request = parse_message(method.request_type, read(message, self.peer))
                answer = await method.handler(request, forwarded)
                reply = self.out.pack_parts(_parts(answer))
                status, text = GrpcStatus.OK, ""
            except Exception as exc:
                status, text = _call_status(exc)
            finally:
                del self._calls[call]
                await self._release(message)
            item = (END, status, text, forwarded.trailers, reply)
            await self._answer(call, item, True, reply)

    async def _grpc_stream(
        self,
        call: int,
        path: str,
        metadata: dict[str, str],
        messages: trio.MemoryReceiveChannel[Payload],
    ) -> None:
        method = self._grpc_methods.get(path)
        forwarded = _ForwardedCall(metadata)
        status, text = GrpcStatus.OK, ""
        with trio.CancelScope() as cancel:
            self._calls[call] = cancel
            try:
                if not isinstance(method, StreamMethod):
                    raise GrpcError(GrpcStatus.UNIMPLEMENTED, f"unknown method {path}")
                await method.handler(_ForwardedStream(self, call, method, messages), forwarded)
            except Exception as exc:
                status, text = _call_status(exc)
            finally:
                del self._calls[call]
                self._streams.pop(call, None)
        await self._answer(call, (END, status, text, forwarded.trailers, b""), True)


Tensor = tuple[str, str, tuple[int, ...], Payload, dict[str, Any]]


class _Inference:
    """An INFER in flight: what its answer needs once its ticket has its outcome."""

    __slots__ = (
        "call", "inputs", "kept", "link", "model", "report", "served", "submitted", "version",
    )  # fmt: skip

    served: ServedModel
    submitted: Submitted

    def __init__(
        self,
        link: WorkerLink,
        call: int,
        model: str,
        version: str,
        inputs: list[Tensor],
        report: tuple[str, Any] | None,
    ) -> None:
        self.link = link
        self.call = call
        self.model = model
        self.version = version
        self.inputs = inputs
        self.kept: list[Block] = []  # input blocks freed once the model lets go of them
        self.report = report

    def finished(self) -> None:
        self.link._finished_inference(self)


def _error(exc: Exception) -> tuple[str, str]:
    """A failed inference's (kind, message); anything but an ``InferenceServerError`` is
    a bug of ours, logged and answered INTERNAL (the link and its other calls go on)."""
    if isinstance(exc, InferenceServerError):
        return exc.kind.name, exc.message
    logger.exception("a forwarded inference failed")
    return ErrorKind.INTERNAL.name, f"internal error: {exc!r}"


def _load_report(context: ServerContext, served: ServedModel, asked: tuple[str, Any] | None) -> Any:
    """The load report an INFER asked for: REST's header, or gRPC's trailers."""
    if asked is None:
        return None
    transport, wanted = asked
    if transport == "http":
        return load_report_header(context.load, served, {FORMAT_HEADER: wanted})
    call = _ForwardedCall({FORMAT_HEADER.decode(): wanted})
    add_load_report(call, context.load, served)
    return call.trailers


def _parts(reply: Any) -> list[bytes | memoryview]:
    return reply.parts if isinstance(reply, WireReply) else [reply.SerializeToString()]


class _ForwardedCall:
    """What a handler sees of a call a worker forwarded (``grpc._call.Call``)."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self.metadata = metadata
        self.trailers: list[tuple[str, bytes]] = []

    def add_trailer(self, key: str, value: bytes) -> None:
        self.trailers.append((key, value))

    def cancel_with(self, withdraw: object) -> None:
        pass  # a forwarded call runs under a cancel scope, which a CANCEL cancels


class _ForwardedStream:
    """A forwarded streaming call's messages (``grpc._call.MessageStream``)."""

    def __init__(
        self,
        link: WorkerLink,
        call: int,
        method: Method,
        messages: trio.MemoryReceiveChannel[Payload],
    ) -> None:
        self._link = link
        self._call = call
        self._method = method
        self._messages = messages

    async def recv(self) -> Any | None:
        try:
            payload = await self._messages.receive()
        except trio.EndOfChannel:
            return None
        try:
            return parse_message(self._method.request_type, read(payload, self._link.peer))
        finally:
            await self._link._release(payload)

    async def send(self, message: Any) -> None:
        data = self._link.out.pack_parts(_parts(message))
        await self._link._answer(self._call, (REPLY, data), False, data)


def _call_status(exc: Exception) -> tuple[GrpcStatus, str]:
    """The status a forwarded gRPC call ends with when its handler raised ``exc``."""
    if isinstance(exc, ClientGone):
        return GrpcStatus.CANCELLED, "the client cancelled the call"
    return status_of(exc)
