"""One gRPC call on an HTTP/2 stream: its request messages as they arrive, and what its
handler sees of it (``_methods.Call`` and, for streaming methods, ``MessageStream``).

The connection feeds a stream the payload of its DATA frames; the stream cuts it into
length-prefixed messages. A message's declared length is checked against the limit
before a byte of it is buffered, and its buffer is allocated once at that size: the
payload is copied in (or received straight into it, see ``direct_view``) and protobuf
parses from that buffer. A message that arrives whole inside one received chunk is not
copied at all: it is a view of the chunk.

Flow control: the connection credits a stream's window as its bytes land in a message
buffer, since the buffer is bounded by the message limit. Complete messages that the
handler has not taken yet are bounded too: past ``queue_limit`` queued bytes the credit
is held back until the handler takes them, so a client that streams faster than its
requests are served waits on its window instead of filling memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ._errors import ClientGone, GrpcError, GrpcStatus, parse_message
from ._methods import Method
from ._wire import MESSAGE_PREFIX, PREFIX_BYTES, decompress


class StreamOwner(Protocol):
    """The connection, as its streams see it."""

    def message_arrived(self, stream: H2Stream) -> None: ...

    def credit_taken(self, stream: H2Stream, credit: int) -> None: ...

    async def send_reply(self, stream: H2Stream, message: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class CallPlan:
    """What a request's header block says about its call, worked out once per distinct
    block (a client repeating its headers gets the same plan from the connection's cache)."""

    method: Method
    metadata: Mapping[str, str]
    timeout_s: float | None = None
    wbits_in: int | None = None
    wbits_out: int | None = None


# A message part this large is received straight into its buffer rather than through
# the connection's receive buffer (one copy less for big tensors).
DIRECT_MIN_BYTES = 64 * 1024

Message = bytes | memoryview | bytearray


class H2Stream:
    """One stream's call state; the connection drives it, the handler reads it."""

    __slots__ = (
        "_compressed",
        "_filled",
        "_message",
        "_owner",
        "_prefix",
        "_waiter",
        "deadline",
        "headers_sent",
        "held_credit",
        "id",
        "limit",
        "local_closed",
        "messages",
        "metadata",
        "method",
        "queue_limit",
        "queued_bytes",
        "recv_window",
        "remote_closed",
        "reset",
        "scope",
        "send_window",
        "started",
        "trailers",
        "unacked",
        "wbits_in",
        "wbits_out",
    )

    def __init__(
        self,
        stream_id: int,
        plan: CallPlan,
        owner: StreamOwner,
        *,
        limit: int,
        queue_limit: int,
        send_window: int,
        recv_window: int,
    ) -> None:
        self.id = stream_id
        self.method = plan.method
        self.metadata = plan.metadata  # ``Call.metadata``, shared by calls of one header block
        self._owner = owner
        self.limit = limit  # the largest message accepted, in bytes
        self.queue_limit = queue_limit
        self.send_window = send_window
        self.recv_window = recv_window
        self.unacked = 0  # bytes received and not yet credited back to the client
        self.held_credit = 0  # credit held back while too much sits queued
        self.messages: deque[Message] = deque()
        self.queued_bytes = 0
        self.remote_closed = False  # the client ended its side (END_STREAM)
        self.local_closed = False  # we sent our END_STREAM (trailers) or reset
        self.reset = False  # the client reset the stream, or the connection is gone
        self.started = False  # a handler task has been started for it
        self.headers_sent = False
        self.scope: trio.CancelScope | None = None  # the handler's, once it runs
        self.deadline: float | None = None  # from grpc-timeout
        self.wbits_in = plan.wbits_in  # request messages' compression (zlib wbits)
        self.wbits_out = plan.wbits_out  # responses', when the client accepts it
        self.trailers: dict[str, bytes] | None = None
        self._waiter: trio.Event | None = None
        # The message being cut out of the DATA payload: its prefix, then its body.
        self._prefix = b""
        self._message: bytearray | None = None
        self._filled = 0
        self._compressed = False

    # --- what the handler sees (Call, MessageStream) -----------------------------------

    def add_trailer(self, key: str, value: bytes) -> None:
        if self.trailers is None:
            self.trailers = {}
        self.trailers[key] = value

    def take(self) -> Message | None:
        """The next complete request message, if one is here."""
        if not self.messages:
            return None
        message = self.messages.popleft()
        self.queued_bytes -= len(message)
        if self.held_credit and self.queued_bytes <= self.queue_limit:
            credit, self.held_credit = self.held_credit, 0
            self._owner.credit_taken(self, credit)
        return message

    async def recv(self) -> Any | None:
        """``MessageStream.recv``: the next request, parsed; None once the client closed
        its side."""
        while True:
            message = self.take()
            if message is not None:
                return parse_message(self.method.request_type, message)
            if self.reset:
                raise ClientGone("the client reset the stream")
            if self.remote_closed:
                return None
            self._waiter = trio.Event()
            await self._waiter.wait()

    async def send(self, message: Any) -> None:
        """``MessageStream.send``: one response message, as the client's windows allow."""
        await self._owner.send_reply(self, message)

    def wake(self) -> None:
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    # --- what the connection feeds it --------------------------------------------------

    def feed(self, chunk: memoryview) -> None:
        """Payload bytes of a DATA frame, in order. Raises ``GrpcError`` for a message
        over the limit or one that cannot be decompressed."""
        while chunk:
            message = self._message
            if message is None:
                if not self._prefix and len(chunk) >= PREFIX_BYTES:
                    flag, size = MESSAGE_PREFIX.unpack_from(chunk)
                    end = PREFIX_BYTES + size
                    if end <= len(chunk) and size <= self.limit:
                        # The whole message is in this chunk: a view, no copy.
                        self._complete(chunk[PREFIX_BYTES:end], flag)
                        chunk = chunk[end:]
                        continue
                need = PREFIX_BYTES - len(self._prefix)
                self._prefix += bytes(chunk[:need])
                chunk = chunk[need:]
                if len(self._prefix) < PREFIX_BYTES:
                    return
                flag, size = MESSAGE_PREFIX.unpack(self._prefix)
                self._prefix = b""
                self._check_size(size)
                self._compressed = flag
                if size == 0:
                    self._complete(b"", flag)
                    continue
                self._message = bytearray(size)
                self._filled = 0
                continue
            take = min(len(chunk), len(message) - self._filled)
            message[self._filled : self._filled + take] = chunk[:take]
            chunk = chunk[take:]
            self._advance(take)

    def direct_view(self, available: int) -> memoryview | None:
        """Where up to ``available`` payload bytes may be received directly, if the
        message being read still needs many."""
        message = self._message
        if message is None:
            return None
        wanted = min(available, len(message) - self._filled)
        if wanted < DIRECT_MIN_BYTES:
            return None
        return memoryview(message)[self._filled : self._filled + wanted]

    def received_directly(self, count: int) -> None:
        self._advance(count)

    def end_remote(self) -> None:
        self.remote_closed = True
        self.wake()

    def _advance(self, count: int) -> None:
        self._filled += count
        message = self._message
        if message is not None and self._filled == len(message):
            self._message = None
            self._complete(message, self._compressed)

    def _check_size(self, size: int) -> None:
        if size > self.limit:
            raise GrpcError(
                GrpcStatus.RESOURCE_EXHAUSTED,
                f"Received message larger than max ({size} vs. {self.limit})",
            )

    def _complete(self, message: Message, compressed: int) -> None:
        if compressed:
            if self.wbits_in is None:
                raise GrpcError(
                    GrpcStatus.INTERNAL, "a compressed message arrived without grpc-encoding"
                )
            message = decompress(message, self.wbits_in, self.limit)
        self.messages.append(message)
        self.queued_bytes += len(message)
        self.wake()
        self._owner.message_arrived(self)
