"""One gRPC call's HTTP/2 stream, as the state machine (``_h2_state``) keeps it: its
windows and ends, and its request messages cut out of DATA as they arrive. No I/O and no
trio: what a handler sees of the call (``_call.Call``, ``MessageStream``) is
``_grpc_call.GrpcStream``, which adds the waiting.

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
not answered yet (``owed``, until its next reply is written): past its budget, a
streaming call waits before it takes another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ._call import Method
from ._errors import GrpcError, GrpcStatus
from ._wire import MESSAGE_PREFIX, PREFIX_BYTES, decompress


class StreamOwner(Protocol):
    """The connection's state, as its streams see it."""

    def message_arrived(self, stream: H2Stream, size: int) -> None: ...

    def message_taken(self, stream: H2Stream, size: int, credit: int) -> None:
        """``size`` bytes left the stream's queue; ``credit`` is window to give back."""


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
    """One stream's call state; the connection's state machine drives it. ``wake`` and
    ``gone`` are what the driver's subclass hears of it."""

    __slots__ = (
        "_compressed",
        "_message",
        "_owner",
        "_prefix",
        "_size",
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
        self.deadline: float | None = None  # from grpc-timeout
        self.wbits_in = plan.wbits_in  # request messages' compression (zlib wbits)
        self.wbits_out = plan.wbits_out  # responses', when the client accepts it
        self.trailers: dict[str, bytes] | None = None
        self.owed: deque[int] = deque()  # sizes of requests a streaming call has not answered
        # The message being cut out of the DATA payload: its prefix, then its body, which
        # grows to its declared ``_size``.
        self._prefix = b""
        self._message: bytearray | None = None
        self._size = 0
        self._compressed = False

    # --- what the call takes of it -----------------------------------------------------

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

    def wake(self) -> None:
        """A message arrived, or the client ended its side: a reader may go on."""

    def gone(self) -> None:
        """The stream ended without an answer (reset, or the connection ended)."""

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
