"""The core process's end of one front-end worker's link: it runs each forwarded call
through the same code a single process runs (the REST app, the gRPC method table), so
every connection, whichever worker took it, gets the same answer.

An INFER (an inference the worker decoded) costs no task: ``_core_infer`` submits it as
its frame is read and answers it with the others finished in the same turn; so do the
INFERs of an INFERS (alike ones the worker sent as one). Every other call runs in a task
of its own. A CANCEL from the worker (its client left) withdraws it, as a client's
disconnect does in one process: an INFER's ticket is withdrawn from its
model's queue, any other call's cancel scope is cancelled. When the link dies (the
worker exited), every call of that worker is withdrawn or cancelled; other workers'
calls go on. A SCRAPE gets the server's metric families as collected, which the worker
renders (the text is most of a scrape's CPU).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import trio

from .._context import ServerContext
from ..grpc import (
    ClientGone,
    GrpcError,
    GrpcStatus,
    Method,
    StreamMethod,
    UnaryMethod,
    WireReply,
    parse_message,
    status_of,
)
from ..ipc import Block, LinkClosed, PendingCalls, SegmentMap, TrioChannel
from ..rest import COMPRESSED_IN_FRONT, COMPRESSIBLE, RestApp
from ._core_infer import ForwardedCall, LinkInferences
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
    INFERS,
    MESSAGE,
    PULL,
    REPLY,
    SCRAPE,
    START,
    Outbound,
    Payload,
    new_arena,
    read,
    unwrap,
)

logger = logging.getLogger("trioserve.workers")

Snapshot = dict[str, dict[str, int]]  # counter group ("http", "grpc", "worker") -> counts

# The worker compresses what its client accepts (protocol work, as decompressing is).
_FORWARDED_EXTENSIONS: dict[str, dict[str, Any]] = {COMPRESSED_IN_FRONT: {}}


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
        self._inferences = LinkInferences(context, self.out, self.peer)
        self._streams: dict[int, trio.MemorySendChannel[Payload]] = {}
        self._pulls: PendingCalls[Snapshot] = PendingCalls()
        self._answers: list[tuple[int, tuple[Any, ...], bool]] = []  # for the next ANSWER
        self._answer_payloads: list[object] = []  # theirs that may be blocks

    async def serve(self, frames: list[tuple[Any, list[int]]]) -> None:
        """Answer calls until the worker closes the link; ``frames``: received already."""
        try:
            async with trio.open_nursery() as calls:
                calls.start_soon(self._inferences.run)
                try:
                    while True:
                        for message, fds in frames:  # a SEGMENTS frame has descriptors
                            message = unwrap(message, fds, self.peer) if fds else message
                            kind = message[0]
                            if kind == INFER:
                                self._inferences.submit(*message[1:])
                            elif kind == INFERS:
                                self._inferences.submit_rows(message)
                            else:
                                self._dispatch(calls, message)
                        frames = await self.channel.receive()
                except LinkClosed:
                    calls.cancel_scope.cancel()  # the worker's clients are gone with it
        finally:
            self._inferences.abandon()
            self._pulls.fail_all(LinkClosed("the worker exited"))
            self.channel.close()
            self.peer.close()
            self.out.arena.close()

    async def counters(self) -> Snapshot:
        """The worker's counters now (raises ``LinkClosed`` if it is gone)."""
        pending = self._pulls.open()
        try:
            await self.out.send((PULL, pending.call))
            answer = await pending.wait()
        finally:
            self._pulls.withdraw(pending.call)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _dispatch(self, calls: trio.Nursery, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == HTTP:
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
        elif kind == SCRAPE:
            calls.start_soon(self._scrape, message[1])
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
        else:
            self._inferences.withdraw(call)

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
            "headers": headers, "scheme": "http", "extensions": _FORWARDED_EXTENSIONS,
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
                answer_headers = list(message.get("headers", ()))
                compressible = message.get(COMPRESSIBLE, False)
                start = (START, message["status"], answer_headers, compressible)
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
                    item = (START, 500, [(b"content-type", b"application/json")], False)
                    await self._answer(call, (*item, b'{"error":"internal error"}', False), True)
            finally:
                del self._calls[call]
                await self._release(body)

    async def _scrape(self, call: int) -> None:
        """The server's metric families, collected once every worker's counters are in
        (``metrics_sources``), for the worker to render; None if it exports none."""
        context = self._context
        families = None
        with trio.CancelScope() as cancel:
            self._calls[call] = cancel
            try:
                if context.registry is not None:
                    for refresh in context.metrics_sources:
                        await refresh()
                    families = list(context.registry.collect())
            except Exception:
                # Answered None, the worker forwards the request: the core's RestApp
                # then fails it (and logs it) as one process would.
                families = None
            finally:
                del self._calls[call]
        if not cancel.cancelled_caught:  # else the worker's client left
            await self._answer(call, (SCRAPE, families), True)

    async def _grpc_unary(
        self, call: int, path: str, metadata: dict[str, str], message: Payload
    ) -> None:
        method = self._grpc_methods.get(path)
        forwarded = ForwardedCall(metadata)
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
        forwarded = ForwardedCall(metadata)
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


def _parts(reply: Any) -> list[bytes | memoryview]:
    return reply.parts if isinstance(reply, WireReply) else [reply.SerializeToString()]


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
