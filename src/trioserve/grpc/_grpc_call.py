"""A gRPC call on the HTTP/2 core, as trio code: what its handler sees (``GrpcStream``, a
``_call.Call`` and ``MessageStream``), its run (deadline, status, trailers) and its
replies (size limit, compression, written as the client's windows allow).

The protocol's state is the connection's (``_h2_state``); the connection's driver
(``CallHost``) sends what is queued and wakes waiting replies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import trio
from google.protobuf.message import Message

from ._call import Reply, UnaryMethod
from ._errors import STATUS_OK, ClientGone, GrpcError, GrpcStatus, parse_message, status_of
from ._h2_frames import Part
from ._h2_outbox import Outbox
from ._h2_state import H2State
from ._h2_stream import H2Stream
from ._wire import MESSAGE_PREFIX, PREFIX_BYTES, compress, response_headers


class CallHost(Protocol):
    """The connection's driver, as its calls see it."""

    state: H2State
    outbox: Outbox
    max_message: int  # the largest reply, in bytes
    max_outbox: int  # unsent bytes past which a reply waits

    async def admit(self, stream: H2Stream, size: int) -> None:
        """Before a streaming call takes a request of ``size`` bytes: wait while the
        connection holds too much for its client, then count it as owed."""

    def repaid(self, stream: H2Stream) -> None:
        """A streaming call answered: its oldest owed request is no longer owed."""

    async def window_opened(self) -> None:
        """Until the client's windows grow (or a stream goes)."""

    def finish(self, stream: H2Stream, status: GrpcStatus, message: str) -> None:
        """End the call with ``status`` (trailers), unless it ended already."""


class GrpcStream(H2Stream):
    """A stream as its handler sees it: ``Call`` and, for streaming methods,
    ``MessageStream``."""

    __slots__ = ("_host", "_waiter", "scope", "withdraw")

    def __init__(self, host: CallHost, *stream: Any) -> None:
        """``stream``: ``H2Stream``'s arguments."""
        H2Stream.__init__(self, *stream)
        self._host = host
        self._waiter: trio.Event | None = None
        self.scope: trio.CancelScope | None = None  # the handler's, once it runs
        self.withdraw: Callable[[], None] | None = None  # ``Call.cancel_with``

    def cancel_with(self, withdraw: Callable[[], None] | None) -> None:
        self.withdraw = withdraw

    def wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def gone(self) -> None:
        self.wake()
        if self.scope is not None:
            self.scope.cancel()
        if self.withdraw is not None:
            self.withdraw()

    async def recv(self) -> Any | None:
        """``MessageStream.recv``: the next request, parsed; None once the client closed
        its side."""
        while True:
            if self.reset:
                raise ClientGone("the client reset the stream")
            if self.messages:
                await self._host.admit(self, len(self.messages[0]))
                message = self.take()
                assert message is not None  # this call is the stream's only reader
                self._host.outbox.flush()  # window credit it gave back
                return parse_message(self.method.request_type, message)
            if self.remote_closed:
                return None
            self._waiter = trio.Event()
            await self._waiter.wait()

    async def send(self, message: Reply) -> None:
        """``MessageStream.send``: one response message, as the client's windows allow."""
        await send_reply(self._host, self, message)
        if self.owed:
            self._host.repaid(self)


async def run_call(host: CallHost, stream: GrpcStream) -> None:
    """Run one call's handler and end the stream with its status.

    A unary call without a deadline runs with no cancel scope of its own: entering
    and leaving one costs about a fifth of a small call. A client's reset reaches
    it through ``Call.cancel_with`` (a model's ticket is withdrawn) or, at the
    latest, when its reply finds the stream reset. Streaming calls and calls with a
    deadline get a scope, which a reset cancels.
    """
    if stream.reset:
        return
    method = stream.method
    status, message = STATUS_OK, ""
    try:
        if isinstance(method, UnaryMethod) and stream.deadline is None:
            await _answer_unary(host, stream, method)
        else:
            deadline = math.inf if stream.deadline is None else stream.deadline
            with trio.CancelScope(deadline=deadline) as scope:
                stream.scope = scope
                if isinstance(method, UnaryMethod):
                    await _answer_unary(host, stream, method)
                else:
                    await method.handler(stream, stream)
            if scope.cancelled_caught:
                if stream.reset:
                    return
                status, message = GrpcStatus.DEADLINE_EXCEEDED, "Deadline Exceeded"
    except ClientGone:
        return
    except Exception as exc:
        status, message = status_of(exc)
    if not stream.reset:
        host.finish(stream, status, message)


async def _answer_unary(host: CallHost, stream: GrpcStream, method: UnaryMethod) -> None:
    data = stream.take()
    if data is None:
        raise GrpcError(GrpcStatus.INVALID_ARGUMENT, "the call carried no request message")
    reply = await method.handler(parse_message(method.request_type, data), stream)
    await send_reply(host, stream, reply)


async def send_reply(host: CallHost, stream: H2Stream, reply: Reply) -> None:
    """One response message, in DATA frames the client's windows allow. A reply in
    parts (``_call.ReplyInParts``) is written part by part, never joined."""
    parts: list[Part] = [reply.SerializeToString()] if isinstance(reply, Message) else reply.parts
    size = sum(map(len, parts))
    limit = host.max_message
    if size > limit:
        raise GrpcError(
            GrpcStatus.RESOURCE_EXHAUSTED, f"Sent message larger than max ({size} vs. {limit})"
        )
    flag = 0
    if stream.wbits_out is not None:
        parts, flag = [compress(b"".join(parts), stream.wbits_out)], 1
        size = len(parts[0])
    outbox = host.outbox
    if outbox.size > host.max_outbox:  # the client is not reading: wait until it does
        await _drain(host, stream)
    sender = host.state.sender
    if not stream.headers_sent:
        stream.headers_sent = True
        sender.queue_headers(stream.id, response_headers(stream.wbits_out), 0)
    rest = sender.queue_message(
        stream, [MESSAGE_PREFIX.pack(flag, size), *parts], PREFIX_BYTES + size
    )
    while rest:
        if stream.reset:
            raise ClientGone("the client reset the stream")
        if outbox.size > host.max_outbox:
            await _drain(host, stream)
        else:
            outbox.flush()
            await host.window_opened()
        rest = sender.queue_message(stream, rest, sum(map(len, rest)))
    if not isinstance(stream.method, UnaryMethod):
        outbox.flush()  # a streamed message goes now; a unary one with its trailers


async def _drain(host: CallHost, stream: H2Stream) -> None:
    host.outbox.flush()
    await host.outbox.drain()
    if stream.reset:
        raise ClientGone("the connection is gone")
