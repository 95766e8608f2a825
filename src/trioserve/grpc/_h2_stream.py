"""One gRPC call on an HTTP/2 stream: its request messages as they arrive, and what its
handler sees of it (``_methods.Call`` and, for streaming methods, ``MessageStream``).

The connection feeds a stream the payload of its DATA frames; the stream cuts it into
length-prefixed messages. A message's declared length is checked against the limit
before a byte of it is buffered, and its buffer grows as its bytes arrive, never ahead
of them by more than the frame being received (a prefix declaring 2 GiB costs nothing
until 2 GiB come): the payload is copied in (or received straight into it, see
``direct_view``) and protobuf parses from that buffer. A message that arrives whole
inside one received chunk is not copied at all: it is a view of the chunk.

Flow control: the connection credits a stream's window as its bytes land in a message
buffer, since the buffer is bounded by the message limit. Complete messages that the
handler has not taken yet are bounded too: past ``queue_limit`` queued bytes the credit
is held back until the handler takes them, so a client that streams faster than its
requests are served waits on its window instead of filling memory. The connection also
counts, across its streams, the requests queued and those a streaming call took and has
not answered yet (``owed``, until its next reply is written): past its budget, ``recv``
waits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ._call import Method
from ._errors import ClientGone, GrpcError, GrpcStatus, parse_message
from ._wire import MESSAGE_PREFIX, PREFIX_BYTES, decompress


class StreamOwner(Protocol):
    """The connection, as its streams see it."""

    def message_arrived(self, stream: H2Stream, size: int) -> None: ...

    def message_taken(self, stream: H2Stream, size: int, credit: int) -> None:
        """``size`` bytes left the stream's queue; ``credit`` is window to give back."""

    async def admit(self, stream: H2Stream, size: int) -> None:
        """Before a streaming call takes a request of ``size`` bytes: wait while the
        connection holds too much for its client, then count it as owed."""

    def repaid(self, size: int) -> None:
        """A streaming call answered: its oldest owed request is no longer owed."""

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
# the connection's receive buffer (one copy less for big tensors), at most this much at
# a time, so that the buffer grows only by what one receive may bring.
DIRECT_MIN_BYTES = 64 * 1024
DIRECT_MAX_BYTES = 1024 * 1024
_ZEROS = memoryview(bytes(DIRECT_MAX_BYTES))

Message = bytes | memoryview | bytearray


class H2Stream:
    """One stream's call state; the connection drives it, the handler reads it."""

    __slots__ = (
        "_compressed",
        "_message",
        "_owner",
        "_prefix",
        "_size",
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
        "owed",
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
        "withdraw",
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
        self.withdraw: Callable[[], None] | None = None  # ``Call.cancel_with``
        self.owed: deque[int] = deque()  # sizes of requests a streaming call has not answered
        self._waiter: trio.Event | None = None
        # The message being cut out of the DATA payload: its prefix, then its body, which
        # grows to its declared ``_size``.
        self._prefix = b""
        self._message: bytearray | None = None
        self._size = 0
        self._compressed = False

    # --- what the handler sees (Call, MessageStream) -----------------------------------

    def cancel_with(self, withdraw: Callable[[], None] | None) -> None:
        self.withdraw = withdraw

    def add_trailer(self, key: str, value: bytes) -> None:
        if self.trailers is None:
            self.trailers = {}
        self.trailers[key] = value

    def take(self) -> Message | None:
        """The next complete request message, if one is here."""
        if not self.messages:
            return None
        message = self.messages.popleft()
        size = len(message)
        self.queued_bytes -= size
        credit = 0
        if self.held_credit and self.queued_bytes <= self.queue_limit:
            credit, self.held_credit = self.held_credit, 0
        self._owner.message_taken(self, size, credit)
        return message

    async def recv(self) -> Any | None:
        """``MessageStream.recv``: the next request, parsed; None once the client closed
        its side."""
        while True:
            if self.reset:
                raise ClientGone("the client reset the stream")
            if self.messages:
                await self._owner.admit(self, len(self.messages[0]))
                message = self.take()
                assert message is not None  # this call is the stream's only reader
                return parse_message(self.method.request_type, message)
            if self.remote_closed:
                return None
            self._waiter = trio.Event()
            await self._waiter.wait()

    async def send(self, message: Any) -> None:
        """``MessageStream.send``: one response message, as the client's windows allow."""
        await self._owner.send_reply(self, message)
        if self.owed:
            self._owner.repaid(self.owed.popleft())

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
                self._message = bytearray()
                self._size = size
                continue
            take = min(len(chunk), self._size - len(message))
            message += chunk[:take]
            chunk = chunk[take:]
            self._advance()

    def direct_view(self, available: int) -> memoryview | None:
        """Where up to ``available`` payload bytes may be received directly, if the
        message being read still needs many: the buffer grows by that much, and
        ``received_directly`` cuts it back to what came."""
        message = self._message
        if message is None:
            return None
        wanted = min(available, self._size - len(message), DIRECT_MAX_BYTES)
        if wanted < DIRECT_MIN_BYTES:
            return None
        filled = len(message)
        message += _ZEROS[:wanted]
        return memoryview(message)[filled:]

    def received_directly(self, view: memoryview, count: int) -> None:
        """``count`` bytes came into ``view`` (from ``direct_view``), which is released."""
        unused = len(view) - count
        view.release()
        message = self._message
        assert message is not None
        if unused:
            del message[len(message) - unused :]
        self._advance()

    def end_remote(self) -> None:
        self.remote_closed = True
        self.wake()

    def _advance(self) -> None:
        message = self._message
        if message is not None and len(message) == self._size:
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
        self._owner.message_arrived(self, len(message))
