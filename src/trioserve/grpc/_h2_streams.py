"""The streams of one HTTP/2 connection's state (``_h2_state.H2State`` is this and its
frames): calls opened from header blocks, fed their DATA within the windows we announced,
and ended by their answer (``finish``) or a reset (``drop``); the requests they hold for
their client (``PendingBudget``), and the events the driver acts on. No I/O, no trio.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping

from .._limits import GrpcLimits
from . import _h2_frames as h2
from ._call import Method, UnaryMethod
from ._errors import GrpcError, GrpcStatus
from ._h2_guard import CoreStatistics, HeaderBlock, PendingBudget, ResetBudget
from ._h2_request import HTTP_431, CallPlans, Refusal
from ._h2_send import Outgoing, Sender
from ._h2_stream import CallPlan, H2Stream, StreamOwner
from ._hpack import HeaderDecoder, HeaderList, HeaderListTooLarge, HpackError
from ._wire import trailers

logger = logging.getLogger("trioserve.grpc")


class Signal(enum.Enum):
    """What the state machine asks of its driver, besides running calls."""

    IDLE = "no stream is open"
    BUSY = "the first stream opened"
    WINDOW_OPENED = "the client's windows grew, or a stream went: waiting replies may go"
    REPAID = "requests owed were answered or dropped: calls waiting to take one may"
    ENDED = "read no more: the connection ended (an error, a drain done, idle)"


# The members as plain names: Python 3.11's enum answers ``Signal.BUSY`` through its
# metaclass's ``__getattr__``, some hundreds of instructions each time, and a call
# passes several of them (2.7% of a unary call's instructions).
IDLE, BUSY, WINDOW_OPENED, REPAID, ENDED = Signal


# An event is a ``Signal``, or a stream whose handler is to run now (a unary call's
# request is complete; a streaming call runs from its HEADERS).
Event = Signal | H2Stream
# H2Stream's signature, all arguments positional.
StreamFactory = Callable[[int, CallPlan, StreamOwner, int, int, int, int], H2Stream]


class H2Streams:
    def __init__(
        self,
        methods: Mapping[str, Method],
        limits: GrpcLimits,
        max_message_bytes: int,
        statistics: CoreStatistics,
        *,
        clock: Callable[[], float],
        out: Outgoing | None = None,
        new_stream: StreamFactory = H2Stream,
    ) -> None:
        self._limits = limits
        self._max_message = max_message_bytes
        self._stats = statistics
        self._clock = clock
        self._new_stream = new_stream
        self.streams: dict[int, H2Stream] = {}
        self.last_stream_id = 0
        self.events: list[Event] = []
        self.out = Outgoing() if out is None else out
        self.sender = Sender(self.out, limits.max_outbox_bytes)
        self._decoder = HeaderDecoder(
            max_header_list_size=limits.max_header_list_bytes, cache_bytes=limits.hpack_cache_bytes
        )
        # A header block still waiting for CONTINUATION; HPACK rarely more than halves.
        self._block = HeaderBlock(2 * limits.max_header_list_bytes, limits.max_continuation_frames)
        self._resets = ResetBudget(limits.max_reset_burst, limits.resets_per_s, clock)
        self.pending = PendingBudget(limits.max_pending_bytes)
        self._plans = CallPlans(methods, limits.hpack_cache_bytes)
        # Receiving: our connection window, credited back as data lands.
        self.recv_window = limits.connection_window_bytes
        self._half_window = limits.connection_window_bytes // 2
        self._unacked = 0
        self.draining = False  # no new streams: we or the client sent GOAWAY
        self.ended = False
        self._opened = 0  # calls opened so far

    # --- what calls tell it of their streams ---------------------------------------------

    def message_arrived(self, stream: H2Stream, size: int) -> None:
        self.pending.queued += size
        if not stream.started:
            self._ready(stream)

    def message_taken(self, stream: H2Stream, size: int, credit: int) -> None:
        self.pending.queued -= size
        if credit and stream.id in self.streams:
            self._credit(stream, credit)
        self._reopen_window()

    def owe(self, stream: H2Stream, size: int) -> None:
        """A streaming call took a request of ``size`` bytes; it owes an answer."""
        self.pending.owed += size
        stream.owed.append(size)

    def repaid(self, stream: H2Stream) -> None:
        """A streaming call answered: its oldest owed request is no longer owed."""
        if stream.owed:
            self.pending.owed -= stream.owed.popleft()
            if self.pending.waiting:
                self.events.append(REPAID)
            self._reopen_window()

    def finish(self, stream: H2Stream, status: GrpcStatus, message: str) -> None:
        """End the call: trailers (trailers-only before any response), then the stream."""
        if stream.local_closed:
            return
        block = trailers(status, message, stream.trailers, only=not stream.headers_sent)
        self.sender.queue_headers(stream.id, block, h2.END_STREAM)
        stream.local_closed = True
        if not stream.remote_closed:
            # The answer is complete while the client still sends: tell it to stop.
            self.out.queue(h2.rst_stream(stream.id, h2.NO_ERROR))
        self._forget(stream)

    def drop(self, stream: H2Stream) -> None:
        """The stream is gone without an answer (reset, or the connection ended)."""
        stream.reset = True
        stream.local_closed = True
        stream.gone()
        self.events.append(WINDOW_OPENED)  # a reply waiting on its window must see it
        self._forget(stream)

    # --- receiving ----------------------------------------------------------------------

    def _reopen_window(self) -> None:
        """Credit the connection's window back once half of it is used, unless the
        client has the connection hold too much (``PendingBudget``)."""
        if self._unacked < self._half_window or self.pending.full:
            return
        self.out.queue(h2.window_update(0, self._unacked))
        self.recv_window += self._unacked
        self._unacked = 0

    def _receiving(self, stream_id: int, length: int) -> H2Stream | None:
        """The stream DATA is for, with its window charged; None if it is to be dropped."""
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "DATA on an idle stream")
            return None  # closed: the client sent before it learned; drop it
        if stream.remote_closed:
            self._reset_stream(stream_id, h2.STREAM_CLOSED, "DATA after END_STREAM")
            return None
        if length > stream.recv_window:
            self._reset_stream(stream_id, h2.FLOW_CONTROL_ERROR, "DATA beyond the stream window")
            return None
        stream.recv_window -= length
        if stream.queued_bytes > stream.queue_limit:
            stream.held_credit += length
        else:
            self._credit(stream, length)
        if stream.local_closed:
            return None  # answered already (an error): what still comes is dropped
        return stream

    def _fed(self, stream: H2Stream, chunk: memoryview, received: int) -> H2Stream | None:
        """Hand payload to a stream: ``received`` bytes that came straight into
        ``chunk`` (``direct_view``), or when 0 ``chunk`` itself. A stream that fails on
        it is answered and dropped; one answered meanwhile takes no more."""
        try:
            if received:
                stream.received_directly(chunk, received)
            else:
                stream.feed(chunk)
        except GrpcError as exc:
            logger.debug("gRPC stream %d refused a message: %s", stream.id, exc.message)
            self.finish(stream, exc.status, exc.message)
            return None
        return None if stream.local_closed else stream

    def _credit(self, stream: H2Stream, count: int) -> None:
        stream.unacked += count
        if stream.unacked >= self._limits.stream_window_bytes // 2 and not stream.remote_closed:
            self.out.queue(h2.window_update(stream.id, stream.unacked))
            stream.recv_window += stream.unacked
            stream.unacked = 0

    # --- headers and calls ---------------------------------------------------------------

    def _on_header_block(self, flags: int, stream_id: int, block: bytes) -> None:
        too_large = False
        try:
            headers = self._decoder.decode(block)
        except HeaderListTooLarge:
            headers, too_large = (), True
        except HpackError as exc:
            raise h2.GoawayError(h2.COMPRESSION_ERROR, str(exc)) from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: they end its side
            if not flags & h2.END_STREAM:
                raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "trailers without END_STREAM")
            self._end_remote(stream)
            return
        if stream_id <= self.last_stream_id:
            return  # a stream we closed already
        self.last_stream_id = stream_id
        if self.draining or len(self.streams) >= self._limits.max_concurrent_streams:
            self._stats.refused_streams += 1
            self.out.queue(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            self._resets.charge()
            return
        if too_large:
            self.sender.queue_headers(stream_id, HTTP_431, h2.END_STREAM)
            return
        self._open_call(stream_id, headers, bool(flags & h2.END_STREAM))

    def _open_call(self, stream_id: int, headers: HeaderList, ended: bool) -> None:
        plan = self._plans.plan(stream_id, headers)
        if isinstance(plan, bytes):  # a plain HTTP answer: not a gRPC call
            self.sender.queue_headers(stream_id, plan, h2.END_STREAM)
            return
        refusal = plan if isinstance(plan, Refusal) else None
        limits = self._limits
        stream = self._new_stream(
            stream_id,
            plan.plan if isinstance(plan, Refusal) else plan,
            self,
            self._max_message,
            limits.stream_window_bytes,
            self.sender.initial_window,
            limits.stream_window_bytes,
        )
        if not self.streams:
            self.events.append(BUSY)
        self.streams[stream_id] = stream
        self._opened += 1
        stream.remote_closed = ended
        if refusal is not None:
            self.finish(stream, refusal.status, refusal.message)
            return
        assert isinstance(plan, CallPlan)
        if plan.timeout_s is not None:
            stream.deadline = self._clock() + plan.timeout_s
        if ended or not isinstance(plan.method, UnaryMethod):
            self._ready(stream)  # streaming calls run at once; unary ones on their message

    def _end_remote(self, stream: H2Stream) -> None:
        """The client ended its side; a unary call still waiting for its message runs
        now (and is answered that none came)."""
        stream.end_remote()
        if not stream.started and not stream.local_closed:
            self._ready(stream)

    def _ready(self, stream: H2Stream) -> None:
        stream.started = True
        self.events.append(stream)

    def _reset_stream(self, stream_id: int, code: int, reason: str) -> None:
        self._stats.stream_errors += 1
        logger.debug("gRPC stream %d reset (%#x): %s", stream_id, code, reason)
        self.out.queue(h2.rst_stream(stream_id, code))
        stream = self.streams.get(stream_id)
        if stream is not None:
            self.drop(stream)
        self._resets.charge()  # a client may provoke resets as cheaply as it sends them

    def _forget(self, stream: H2Stream) -> None:
        if self.streams.pop(stream.id, None) is None:
            return
        self.pending.queued -= stream.queued_bytes
        if stream.owed:
            self.pending.owed -= sum(stream.owed)
            stream.owed.clear()
            if self.pending.waiting:
                self.events.append(REPAID)
        if not self.streams:
            self.events.append(IDLE)
            if self.draining:
                self._end()

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.events.append(ENDED)
