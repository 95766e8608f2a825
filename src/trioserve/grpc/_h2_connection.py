"""One HTTP/2 connection carrying gRPC calls (RFC 9113, server side, h2c or TLS).

Shape: one task reads and dispatches frames; each call runs in a task of its own in the
connection's nursery (unary calls once their request message is complete, streaming
calls at their HEADERS); writes are queued synchronously by whichever task answers and
sent at once when the socket takes them, by a writer task otherwise. So a small unary
call costs one ``recv`` for its request and one ``sendmsg`` for HEADERS, DATA and
trailers together, and no task ever blocks another on a slow socket.

Defences (tests in tests/grpc/test_h2_core.py and test_h2_*.py), each bound a
``GrpcLimits`` field; what they count is ``_h2_guard.CoreStatistics``:
* frames of unknown type are ignored; malformed ones end the stream or the connection
  with the code RFC 9113 gives, never an exception out of the connection;
* MAX_CONCURRENT_STREAMS is enforced (REFUSED_STREAM); resets either side sends and
  refused streams draw on ``_h2_guard.ResetBudget``; header blocks are bounded in bytes
  and frames (``HeaderBlock``), the HPACK cache in bytes;
* a message is refused by its declared length and buffered as it arrives (``_h2_stream``);
* past ``max_outbox_bytes`` unsent the reader stops (a client that never reads its PING
  ACKs) and replies wait (``_h2_send``); requests queued or unanswered are bounded per
  connection (``_h2_guard.PendingBudget``);
* the reader checkpoints after each ``_YIELD_BYTES`` read and ``_YIELD_FRAMES`` frames;
* a stream's buffers go the moment it ends, a connection's when it closes;
* a connection with no stream open for ``idle_timeout_s`` is closed with GOAWAY, and
  past a share of the connection limit the one idle longest gives way to a new one.
Client mistakes are logged at DEBUG and counted, never as tracebacks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import trio

from .._limits import GrpcLimits
from . import _h2_frames as h2
from ._errors import GrpcError, GrpcStatus
from ._h2_calls import run_call
from ._h2_guard import (
    CoreStatistics,
    HeaderBlock,
    IdleRoster,
    PendingBudget,
    ResetBudget,
    count,
    header_fragment,
)
from ._h2_outbox import Outbox
from ._h2_request import HTTP_431, CallPlans, Refusal
from ._h2_send import Sender
from ._h2_stream import CallPlan, H2Stream
from ._h2_transport import Transport
from ._hpack import HeaderDecoder, HeaderList, HeaderListTooLarge, HpackError
from ._methods import Method, UnaryMethod
from ._wire import trailers

logger = logging.getLogger("trioserve.grpc")

# How long a closing connection may take to flush what it queued.
_FLUSH_S = 5.0
# The reader checkpoints after this much read, or this many frames handled, in a row:
# a client whose socket never runs dry must not keep every other client waiting.
_YIELD_BYTES = 256 * 1024
_YIELD_FRAMES = 1024
# Parts the outbox may hold before the reader waits, whatever their bytes: each is an
# object, and a flood of PINGs queues 17-byte ACKs, 250,000 of them in 4 MiB.
_OUTBOX_PARTS = 16 * 1024


class _PeerGone(Exception):
    pass


class H2Connection:
    def __init__(
        self,
        transport: Transport,
        methods: Mapping[str, Method],
        limits: GrpcLimits,
        max_message_bytes: int,
        statistics: CoreStatistics,
        roster: IdleRoster,
        *,
        greeted: bytes | None = None,
    ) -> None:
        self._transport = transport
        # The server's opening frames went out as the socket was accepted, and this is
        # what the client had sent then (_core.greet); None: they are sent here.
        self._greeted = greeted
        self._max_message = max_message_bytes
        self._limits = limits
        self._stats = statistics
        self._roster = roster
        self._streams: dict[int, H2Stream] = {}
        self._last_stream_id = 0
        self._decoder = HeaderDecoder(
            max_header_list_size=limits.max_header_list_bytes, cache_bytes=limits.hpack_cache_bytes
        )
        # A header block still waiting for CONTINUATION; HPACK rarely more than halves.
        self._block = HeaderBlock(2 * limits.max_header_list_bytes, limits.max_continuation_frames)
        self._resets = ResetBudget(limits.max_reset_burst, limits.resets_per_s)
        self._pending = PendingBudget(limits.max_pending_bytes)
        # Receiving: our windows, credited back as data lands.
        self._recv_window = limits.connection_window_bytes
        self._half_window = limits.connection_window_bytes // 2
        self._unacked = 0
        self._since_yield = 0  # bytes read since the reader last checkpointed
        # Writing.
        self._outbox = Outbox(transport, self._fail)
        self._sender = Sender(self._outbox, max_message_bytes, limits.max_outbox_bytes)
        # Lifetime.
        self._reader = trio.CancelScope()
        self._calls: trio.Nursery | None = None
        self._draining = False
        self._plans = CallPlans(methods, limits.hpack_cache_bytes)
        # Idle detection, by the server's sweeper (``idle_tick``): calls opened so far,
        # and how many ticks have passed with no call open and none opened.
        self._opened = 0
        self._seen_opened = 0
        self._idle_ticks = 0
        self._closed_as: str | None = None  # the counter of an idle connection's close

    # --- lifetime ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until the client leaves, the connection fails or idles, or a drain ends."""
        self._roster.idle(self)
        try:
            async with trio.open_nursery() as calls:
                self._calls = calls
                calls.start_soon(self._outbox.write_forever)
                try:
                    with self._reader:
                        await self._read_forever()
                except h2.ConnectionError_ as exc:
                    self._stats.protocol_errors += 1
                    if exc.counter is not None:
                        count(self._stats, exc.counter)
                    logger.debug("gRPC connection error %#x: %s", exc.code, exc.reason)
                    self._outbox.queue(
                        h2.goaway(self._last_stream_id, exc.code, exc.reason.encode())
                    )
                except _PeerGone:
                    await self._roster.departures.leave_in_turn()  # not a whole crowd at once
                else:
                    if self._closed_as is not None:
                        count(self._stats, self._closed_as)
                        self._outbox.queue(h2.goaway(self._last_stream_id, h2.NO_ERROR, b"idle"))
                for stream in list(self._streams.values()):
                    self._drop(stream)
                self._outbox.flush()
                with trio.move_on_after(_FLUSH_S):
                    await self._outbox.drain()
                calls.cancel_scope.cancel()
        except Exception:
            logger.exception("gRPC connection failed")
        finally:
            self._transport.close()
            self._release()

    def _release(self) -> None:
        """Let go of what the client made the connection keep, at once rather than when
        the collector finds the connection's reference cycles."""
        self._roster.gone(self)
        self._stats.hpack_cache_evictions += self._decoder.cache.evictions + self._plans.evictions
        self._stats.pending_pauses += self._pending.pauses
        self._decoder.cache.clear()
        self._plans.clear()
        self._block.clear()
        self._streams.clear()

    def begin_shutdown(self) -> None:
        """Drain: GOAWAY now (no new streams), close once the open ones are done."""
        if self._draining:
            return
        self._draining = True
        self._outbox.queue(h2.goaway(self._last_stream_id, h2.NO_ERROR))
        self._outbox.flush()
        if not self._streams:
            self._reader.cancel()

    def idle_tick(self, limit: int) -> None:
        """One tick of the server's sweeper: close the connection once it has had no
        call open for ``limit`` ticks in a row. (Counting beats a deadline per call:
        moving a cancel scope's deadline costs more than the rest of opening a call.)"""
        if self._streams or self._opened != self._seen_opened:
            self._seen_opened = self._opened
            self._idle_ticks = 0
            return
        self._idle_ticks += 1
        if self._idle_ticks >= limit:
            self.close_idle("idle_closed")

    def close_idle(self, counter: str) -> None:
        """Close with GOAWAY(NO_ERROR) if no call is open, counted in ``counter``."""
        if not self._streams and not self._draining:
            self._closed_as = counter
            self._reader.cancel()

    # --- reading -------------------------------------------------------------------------

    async def _read_forever(self) -> None:
        transport = self._transport
        greeted, self._greeted = self._greeted, None  # its bytes are the reader's now
        buf = greeted or b""
        while len(buf) < len(h2.PREFACE) and h2.PREFACE.startswith(buf):
            buf += await self._recv()
        if not buf.startswith(h2.PREFACE):
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        if greeted is None:
            self._outbox.queue(h2.opening_frames(self._limits))
            self._outbox.flush()
        pos = len(h2.PREFACE)
        first = True
        max_frame = self._limits.max_frame_bytes
        frames = 0
        while True:
            frames += 1
            if frames == _YIELD_FRAMES:
                frames = 0
                await trio.lowlevel.checkpoint()
            while len(buf) - pos < h2.FRAME_HEADER_BYTES:
                buf = buf[pos:] + await self._recv()
                pos = 0
            high, low, kind, flags, stream_id = h2.HEADER.unpack_from(buf, pos)
            length = high << 16 | low
            stream_id &= 0x7FFFFFFF
            pos += h2.FRAME_HEADER_BYTES
            if first and kind != h2.SETTINGS:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "the preface must end in SETTINGS")
            first = False
            if length > max_frame:
                raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if kind == h2.DATA:
                buf, pos = await self._read_data(transport, buf, pos, length, flags, stream_id)
                continue
            if self._block.open and kind != h2.CONTINUATION:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "a header block was interrupted")
            if kind > h2.CONTINUATION:  # an extension frame: skip it unread
                buf, pos = await self._skip(buf, pos, length)
                continue
            if kind in (h2.HEADERS, h2.CONTINUATION):
                self._block.check(length)
            while len(buf) - pos < length:
                buf = buf[pos:] + await self._recv()
                pos = 0
            payload = buf[pos : pos + length]
            pos += length
            try:
                self._on_frame(kind, flags, stream_id, payload)
            except h2.StreamError as exc:
                self._reset_stream(exc.stream_id, exc.code, exc.reason)
            self._outbox.flush()

    async def _recv(self) -> bytes:
        if self._since_yield >= _YIELD_BYTES or self._outbox.parts:
            await self._pace()  # a call only when there may be something to wait for
        data = await self._transport.recv()
        if not data:
            raise _PeerGone
        self._since_yield += len(data)
        return data

    async def _pace(self) -> None:
        """Before reading more: wait while the client leaves what we sent unread (each
        frame read may queue an answer: a PING its ACK), and give other tasks their turn
        after a run of reads."""
        outbox = self._outbox
        if outbox.size > self._limits.max_outbox_bytes or len(outbox.parts) > _OUTBOX_PARTS:
            self._stats.outbox_pauses += 1
            outbox.flush()
            await outbox.drain()
        if self._since_yield >= _YIELD_BYTES:
            self._since_yield = 0
            await trio.lowlevel.checkpoint()

    async def _skip(self, buf: bytes, pos: int, length: int) -> tuple[bytes, int]:
        while len(buf) - pos < length:
            length -= len(buf) - pos
            buf, pos = await self._recv(), 0
        return buf, pos + length

    async def _read_data(
        self, transport: Transport, buf: bytes, pos: int, length: int, flags: int, stream_id: int
    ) -> tuple[bytes, int]:
        if stream_id == 0:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "DATA on stream 0")
        if self._block.open:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "a header block was interrupted")
        if length > self._recv_window:
            raise h2.ConnectionError_(h2.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_window -= length
        self._unacked += length
        body = length
        if flags & h2.PADDED:
            if length == 0:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "padded DATA without a pad length")
            while len(buf) - pos < 1:
                buf, pos = await self._recv(), 0
            padding = buf[pos]
            pos += 1
            body = length - 1 - padding
            if body < 0:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "padding longer than the frame")
        else:
            padding = 0
        stream = self._receiving(stream_id, length)
        while body:
            available = len(buf) - pos
            if stream is not None and available == 0:
                if self._since_yield >= _YIELD_BYTES or self._outbox.parts:
                    await self._pace()
                view = stream.direct_view(body)
                if view is not None:
                    received = await transport.recv_into(view)
                    if not received:
                        raise _PeerGone
                    self._since_yield += received
                    body -= received
                    stream = self._fed(stream, view, received)
                    continue
            if available == 0:
                buf, pos = await self._recv(), 0
                continue
            take = min(available, body)
            if stream is not None:
                stream = self._fed(stream, memoryview(buf)[pos : pos + take], 0)
            pos += take
            body -= take
        buf, pos = await self._skip(buf, pos, padding)
        if stream is not None and flags & h2.END_STREAM:
            stream.end_remote()
        self._reopen_window()
        self._outbox.flush()
        return buf, pos

    def _reopen_window(self) -> bool:
        """Credit the connection's window back once half of it is used, unless the
        client has the connection hold too much (``PendingBudget``)."""
        if self._unacked < self._half_window or self._pending.full:
            return False
        self._outbox.queue(h2.window_update(0, self._unacked))
        self._recv_window += self._unacked
        self._unacked = 0
        return True

    def _receiving(self, stream_id: int, length: int) -> H2Stream | None:
        """The stream DATA is for, with its window charged; None if it is to be dropped."""
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream_id:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "DATA on an idle stream")
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
        it is answered and dropped."""
        try:
            if received:
                stream.received_directly(chunk, received)
            else:
                stream.feed(chunk)
        except GrpcError as exc:
            logger.debug("gRPC stream %d refused a message: %s", stream.id, exc.message)
            self.finish_now(stream, exc.status, exc.message)
            return None
        return stream

    def _credit(self, stream: H2Stream, count: int) -> None:
        stream.unacked += count
        if stream.unacked >= self._limits.stream_window_bytes // 2 and not stream.remote_closed:
            self._outbox.queue(h2.window_update(stream.id, stream.unacked))
            stream.recv_window += stream.unacked
            stream.unacked = 0

    # --- what streams tell of their requests (``StreamOwner``) ---------------------------

    def message_arrived(self, stream: H2Stream, size: int) -> None:
        self._pending.queued += size
        if not stream.started:
            self._start(stream)

    def message_taken(self, stream: H2Stream, size: int, credit: int) -> None:
        self._pending.queued -= size
        if credit and stream.id in self._streams:
            self._credit(stream, credit)
            self._outbox.flush()
        if self._reopen_window():
            self._outbox.flush()

    async def admit(self, stream: H2Stream, size: int) -> None:
        await self._pending.admit(bool(stream.owed), size)
        stream.owed.append(size)

    def repaid(self, size: int) -> None:
        self._pending.repay(size)
        if self._reopen_window():
            self._outbox.flush()

    async def send_reply(self, stream: H2Stream, message: Any) -> None:
        await self._sender.send_reply(stream, message)

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == h2.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == h2.CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == h2.SETTINGS:
            if stream_id:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & h2.ACK:
                self._sender.on_settings(payload, self._streams.values())
            elif payload:
                raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
        elif kind == h2.WINDOW_UPDATE:
            self._sender.on_window_update(stream_id, payload, self._streams, self._last_stream_id)
        elif kind == h2.PING:
            if stream_id:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "PING payload is not 8 bytes")
            if not flags & h2.ACK:
                self._outbox.queue(h2.ping_ack(payload))
        elif kind == h2.RST_STREAM:
            self._on_rst_stream(stream_id, payload)
        elif kind == h2.PRIORITY:
            if stream_id == 0:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise h2.StreamError(stream_id, h2.FRAME_SIZE_ERROR, "PRIORITY is not 5 bytes")
        elif kind == h2.GOAWAY:
            if stream_id:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "GOAWAY on a stream")
            self._draining = True  # the client opens no more streams
            if not self._streams:
                self._reader.cancel()
        elif kind == h2.PUSH_PROMISE:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "a client may not push")

    def _on_rst_stream(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "RST_STREAM is not 4 bytes")
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > self._last_stream_id:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            return
        self._drop(stream)
        self._resets.charge()

    # --- headers and calls ---------------------------------------------------------------

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "HEADERS on an invalid stream id")
        fragment = header_fragment(flags, payload)
        if flags & h2.END_HEADERS:
            self._on_header_block(flags, stream_id, fragment)
        else:
            self._block.begin(flags, stream_id, fragment)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        block = self._block.add(flags, stream_id, payload)
        if block is not None:
            self._on_header_block(self._block.flags, stream_id, block)

    def _on_header_block(self, flags: int, stream_id: int, block: bytes) -> None:
        too_large = False
        try:
            headers = self._decoder.decode(block)
        except HeaderListTooLarge:
            headers, too_large = (), True
        except HpackError as exc:
            raise h2.ConnectionError_(h2.COMPRESSION_ERROR, str(exc)) from None
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client: they end its side
            if not flags & h2.END_STREAM:
                raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "trailers without END_STREAM")
            stream.end_remote()
            return
        if stream_id <= self._last_stream_id:
            return  # a stream we closed already
        self._last_stream_id = stream_id
        if self._draining or len(self._streams) >= self._limits.max_concurrent_streams:
            self._stats.refused_streams += 1
            self._outbox.queue(h2.rst_stream(stream_id, h2.REFUSED_STREAM))
            self._resets.charge()
            return
        if too_large:
            self._answer_http(stream_id, HTTP_431)
            return
        self._open_call(stream_id, headers, bool(flags & h2.END_STREAM))

    def _open_call(self, stream_id: int, headers: HeaderList, ended: bool) -> None:
        plan = self._plans.plan(stream_id, headers)
        if isinstance(plan, bytes):
            self._answer_http(stream_id, plan)
            return
        refusal = plan if isinstance(plan, Refusal) else None
        limits = self._limits
        stream = H2Stream(
            stream_id,
            plan.plan if isinstance(plan, Refusal) else plan,
            self,
            limit=self._max_message,
            queue_limit=limits.stream_window_bytes,
            send_window=self._sender.initial_window,
            recv_window=limits.stream_window_bytes,
        )
        if not self._streams:
            self._roster.busy(self)
        self._streams[stream_id] = stream
        self._opened += 1
        stream.remote_closed = ended
        if refusal is not None:
            self.finish_now(stream, refusal.status, refusal.message)
            return
        assert isinstance(plan, CallPlan)
        if plan.timeout_s is not None:
            stream.deadline = trio.current_time() + plan.timeout_s
        if ended or not isinstance(plan.method, UnaryMethod):
            self._start(stream)  # streaming calls run at once; unary ones on their message

    def _start(self, stream: H2Stream) -> None:
        stream.started = True
        assert self._calls is not None
        self._calls.start_soon(run_call, self, stream)

    def finish_now(self, stream: H2Stream, status: GrpcStatus, message: str) -> None:
        """End the call: trailers (trailers-only before any response), then the stream."""
        if stream.local_closed:
            return
        block = trailers(status, message, stream.trailers, only=not stream.headers_sent)
        self._sender.queue_headers(stream.id, block, h2.END_STREAM)
        stream.local_closed = True
        if not stream.remote_closed:
            # The answer is complete while the client still sends: tell it to stop.
            self._outbox.queue(h2.rst_stream(stream.id, h2.NO_ERROR))
        self._forget(stream)
        self._outbox.flush()

    def _answer_http(self, stream_id: int, block: bytes) -> None:
        """A plain HTTP answer to a request that is not a gRPC call."""
        self._sender.queue_headers(stream_id, block, h2.END_STREAM)

    def _reset_stream(self, stream_id: int, code: int, reason: str) -> None:
        self._stats.stream_errors += 1
        logger.debug("gRPC stream %d reset (%#x): %s", stream_id, code, reason)
        self._outbox.queue(h2.rst_stream(stream_id, code))
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._drop(stream)
        self._resets.charge()  # a client may provoke resets as cheaply as it sends them

    def _drop(self, stream: H2Stream) -> None:
        """The stream is gone without an answer (reset, or the connection ended)."""
        stream.reset = True
        stream.local_closed = True
        stream.wake()
        if stream.scope is not None:
            stream.scope.cancel()
        if stream.withdraw is not None:
            stream.withdraw()
        self._sender.open_window()  # a sender waiting on its window must see the reset
        self._forget(stream)

    def _forget(self, stream: H2Stream) -> None:
        if self._streams.pop(stream.id, None) is None:
            return
        self._pending.queued -= stream.queued_bytes
        if stream.owed:
            self._pending.repay(sum(stream.owed))
            stream.owed.clear()
        if not self._streams:
            self._roster.idle(self)
            if self._draining:
                self._reader.cancel()

    # --- writing -------------------------------------------------------------------------

    def _fail(self) -> None:
        """The socket failed: nothing more can be sent, so the connection ends."""
        self._reader.cancel()
        for stream in list(self._streams.values()):
            self._drop(stream)
