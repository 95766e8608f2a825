"""One HTTP/2 connection carrying gRPC calls (RFC 9113, server side, h2c or TLS).

Shape: one task reads and dispatches frames; each call runs in a task of its own in the
connection's nursery (unary calls once their request message is complete, streaming
calls at their HEADERS); writes are queued synchronously by whichever task answers and
sent at once when the socket takes them, by a writer task otherwise. So a small unary
call costs one ``recv`` for its request and one ``sendmsg`` for HEADERS, DATA and
trailers together, and no task ever blocks another on a slow socket.

Defences (each is a test in tests/grpc/test_h2_core.py):
* frames of unknown type are ignored; malformed ones end the stream or the connection
  with the code RFC 9113 gives, never an exception out of the connection;
* MAX_CONCURRENT_STREAMS is enforced (REFUSED_STREAM), and client resets and refused
  streams draw on a token bucket: a "rapid reset" flood gets GOAWAY(ENHANCE_YOUR_CALM);
* a header block (HEADERS + CONTINUATION) is bounded before it is decoded;
* a message is refused by its declared length before it is buffered (``_h2_stream``);
* a stream's buffers go the moment it ends; streamed responses wait on the client's
  flow-control window, and the queue of unsent bytes is bounded;
* a connection with no stream open for ``idle_timeout_s`` is closed with GOAWAY.
Client mistakes are logged at DEBUG and counted (``CoreStatistics``), never as tracebacks.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import trio

from .._limits import GrpcLimits
from . import _h2_frames as h2
from ._errors import ClientGone, GrpcError, GrpcStatus, parse_message, status_of
from ._h2_outbox import Outbox
from ._h2_request import HTTP_431, Refusal, plan_call
from ._h2_stream import CallPlan, H2Stream
from ._h2_transport import Transport, trim
from ._hpack import HeaderDecoder, HeaderList, HeaderListTooLarge, HpackError
from ._infer_wire import WireReply
from ._methods import Method, UnaryMethod
from ._wire import MESSAGE_PREFIX, compress, response_headers, trailers

logger = logging.getLogger("trioserve.grpc")

# Unsent bytes a connection may queue before answering tasks wait for the socket.
_OUTBOX_HIGH = 4 * 1024 * 1024
# How long a closing connection may take to flush what it queued.
_FLUSH_S = 5.0
# Call plans a connection keeps (distinct header blocks; a client has a handful).
_PLANS = 64
# Client resets (and refused streams) allowed in a burst, and refilled per second.
_RESET_BURST = 1000
_RESET_RATE = 200.0


@dataclass
class CoreStatistics:
    """Counts a server's connections keep of what clients did wrong."""

    protocol_errors: int = 0  # connections ended by GOAWAY with an error code
    stream_errors: int = 0  # streams reset by us
    refused_streams: int = 0  # over MAX_CONCURRENT_STREAMS or after GOAWAY
    calm_goaways: int = 0  # connections ended for resetting too many streams
    idle_closed: int = 0  # connections closed for being idle
    refused_connections: int = 0  # closed on accept, over the connection limit


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
    ) -> None:
        self._transport = transport
        self._max_message = max_message_bytes
        self._methods = methods
        self._limits = limits
        self._stats = statistics
        self._streams: dict[int, H2Stream] = {}
        self._last_stream_id = 0
        self._decoder = HeaderDecoder(max_header_list_size=limits.max_header_list_bytes)
        self._max_block = 2 * limits.max_header_list_bytes
        self._block: list[bytes] = []  # a header block still waiting for CONTINUATION
        self._block_stream = 0
        self._block_flags = 0
        self._block_bytes = 0
        # Sending: the client's windows and frame size.
        self._send_window = h2.DEFAULT_WINDOW
        self._peer_initial_window = h2.DEFAULT_WINDOW
        self._peer_max_frame = h2.DEFAULT_MAX_FRAME
        self._window_opened = trio.Event()
        # Receiving: our windows, credited back as data lands.
        self._recv_window = limits.connection_window_bytes
        self._unacked = 0
        # Writing.
        self._outbox = Outbox(transport, self._fail)
        # Lifetime.
        self._reader = trio.CancelScope()
        self._calls: trio.Nursery | None = None
        self._draining = False
        # Call plans by header block: the decoder hands back the very same block object
        # for a repeated block, so a client repeating its headers is planned once.
        self._plans: dict[int, tuple[HeaderList, CallPlan | bytes | Refusal]] = {}
        # Idle detection, by the server's sweeper (``idle_tick``): calls opened so far,
        # and how many ticks have passed with no call open and none opened.
        self._opened = 0
        self._seen_opened = 0
        self._idle_ticks = 0
        self._idle = False
        self._reset_tokens = float(_RESET_BURST)
        self._reset_time = trio.current_time()

    # --- lifetime ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until the client leaves, the connection fails or idles, or a drain ends."""
        try:
            async with trio.open_nursery() as calls:
                self._calls = calls
                calls.start_soon(self._outbox.write_forever)
                try:
                    with self._reader:
                        await self._read_forever()
                except h2.ConnectionError_ as exc:
                    self._stats.protocol_errors += 1
                    if exc.code == h2.ENHANCE_YOUR_CALM:
                        self._stats.calm_goaways += 1
                    logger.debug("gRPC connection error %#x: %s", exc.code, exc.reason)
                    self._outbox.queue(
                        h2.goaway(self._last_stream_id, exc.code, exc.reason.encode())
                    )
                except _PeerGone:
                    pass
                else:
                    if self._idle:
                        self._stats.idle_closed += 1
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
        if self._idle_ticks >= limit and not self._draining:
            self._idle = True
            self._reader.cancel()

    # --- reading -------------------------------------------------------------------------

    async def _read_forever(self) -> None:
        transport = self._transport
        buf = b""
        while len(buf) < len(h2.PREFACE) and h2.PREFACE.startswith(buf):
            buf += await self._recv()
        if not buf.startswith(h2.PREFACE):
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
        self._outbox.queue(self._opening_frames())
        self._outbox.flush()
        pos = len(h2.PREFACE)
        first = True
        max_frame = self._limits.max_frame_bytes
        while True:
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
            if self._block and kind != h2.CONTINUATION:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "a header block was interrupted")
            if kind > h2.CONTINUATION:  # an extension frame: skip it unread
                buf, pos = await self._skip(buf, pos, length)
                continue
            if (
                kind in (h2.HEADERS, h2.CONTINUATION)
                and self._block_bytes + length > self._max_block
            ):
                raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, "header block too large")
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
        data = await self._transport.recv()
        if not data:
            raise _PeerGone
        return data

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
        if self._block:
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
                view = stream.direct_view(body)
                if view is not None:
                    count = await transport.recv_into(view)
                    if not count:
                        raise _PeerGone
                    body -= count
                    stream = self._fed(stream, None, count)
                    continue
            if available == 0:
                buf, pos = await self._recv(), 0
                continue
            take = min(available, body)
            if stream is not None:
                stream = self._fed(stream, memoryview(buf)[pos : pos + take], take)
            pos += take
            body -= take
        buf, pos = await self._skip(buf, pos, padding)
        if stream is not None and flags & h2.END_STREAM:
            stream.end_remote()
        if self._unacked >= self._limits.connection_window_bytes // 2:
            self._outbox.queue(h2.window_update(0, self._unacked))
            self._recv_window += self._unacked
            self._unacked = 0
        self._outbox.flush()
        return buf, pos

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

    def _fed(self, stream: H2Stream, chunk: memoryview | None, count: int) -> H2Stream | None:
        """Hand payload to a stream; a stream that fails on it is answered and dropped."""
        try:
            if chunk is None:
                stream.received_directly(count)
            else:
                stream.feed(chunk)
        except GrpcError as exc:
            logger.debug("gRPC stream %d refused a message: %s", stream.id, exc.message)
            self._finish_now(stream, exc.status, exc.message)
            return None
        return stream

    def _credit(self, stream: H2Stream, count: int) -> None:
        stream.unacked += count
        if stream.unacked >= self._limits.stream_window_bytes // 2 and not stream.remote_closed:
            self._outbox.queue(h2.window_update(stream.id, stream.unacked))
            stream.recv_window += stream.unacked
            stream.unacked = 0

    def credit_taken(self, stream: H2Stream, credit: int) -> None:
        if stream.id in self._streams:
            self._credit(stream, credit)
            self._outbox.flush()

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == h2.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == h2.CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == h2.SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == h2.WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
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

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        for key, value in h2.parse_settings(payload):
            if key == h2.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise h2.ConnectionError_(h2.FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self._streams.values():
                    stream.send_window += delta
                self._open_window()
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= h2.MAX_FRAME_LIMIT:
                    raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "invalid MAX_FRAME_SIZE")
                self._peer_max_frame = value
            elif key == h2.ENABLE_PUSH and value > 1:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "invalid ENABLE_PUSH")
        self._outbox.queue(h2.SETTINGS_ACK)

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise h2.ConnectionError_(h2.FRAME_SIZE_ERROR, "WINDOW_UPDATE is not 4 bytes")
        increment = h2.read_u32(payload) & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > h2.MAX_WINDOW:
                raise h2.ConnectionError_(h2.FLOW_CONTROL_ERROR, "connection window overflow")
        else:
            stream = self._streams.get(stream_id)
            if stream is None:
                if stream_id > self._last_stream_id:
                    raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
                return
            if increment == 0:
                raise h2.StreamError(stream_id, h2.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            stream.send_window += increment
            if stream.send_window > h2.MAX_WINDOW:
                raise h2.StreamError(stream_id, h2.FLOW_CONTROL_ERROR, "stream window overflow")
        self._open_window()

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
        self._charge_reset()

    def _charge_reset(self) -> None:
        """Resets and refusals draw on a bucket; an empty bucket ends the connection."""
        now = trio.current_time()
        tokens = self._reset_tokens + (now - self._reset_time) * _RESET_RATE
        self._reset_tokens = min(float(_RESET_BURST), tokens) - 1
        self._reset_time = now
        if self._reset_tokens < 0:
            raise h2.ConnectionError_(h2.ENHANCE_YOUR_CALM, "too many streams reset")

    # --- headers and calls ---------------------------------------------------------------

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "HEADERS on an invalid stream id")
        start = 0
        end = len(payload)
        if flags & h2.PADDED:
            if not payload:
                raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "padded HEADERS without a pad length")
            end -= payload[0]
            start = 1
        if flags & h2.PRIORITY_FLAG:
            start += 5
        if end < start:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "HEADERS padding longer than the frame")
        fragment = payload[start:end]
        if flags & h2.END_HEADERS:
            self._on_header_block(flags, stream_id, fragment)
        else:
            self._block = [fragment]
            self._block_stream = stream_id
            self._block_flags = flags
            self._block_bytes = len(fragment)

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not self._block or stream_id != self._block_stream:
            raise h2.ConnectionError_(h2.PROTOCOL_ERROR, "CONTINUATION out of place")
        self._block.append(payload)
        self._block_bytes += len(payload)
        if flags & h2.END_HEADERS:
            block = b"".join(self._block)
            self._block = []
            self._block_bytes = 0
            self._on_header_block(self._block_flags, stream_id, block)

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
            self._charge_reset()
            return
        if too_large:
            self._answer_http(stream_id, HTTP_431)
            return
        self._open_call(stream_id, headers, bool(flags & h2.END_STREAM))

    def _open_call(self, stream_id: int, headers: HeaderList, ended: bool) -> None:
        entry = self._plans.get(id(headers))
        if entry is not None and entry[0] is headers:
            plan = entry[1]
        else:
            plan = plan_call(stream_id, headers, self._methods)
            if len(self._plans) >= _PLANS:
                self._plans.clear()
            self._plans[id(headers)] = (headers, plan)  # holding it keeps the id unique
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
            send_window=self._peer_initial_window,
            recv_window=limits.stream_window_bytes,
        )
        self._streams[stream_id] = stream
        self._opened += 1
        stream.remote_closed = ended
        if refusal is not None:
            self._finish_now(stream, refusal.status, refusal.message)
            return
        assert isinstance(plan, CallPlan)
        if plan.timeout_s is not None:
            stream.deadline = trio.current_time() + plan.timeout_s
        if ended or not isinstance(plan.method, UnaryMethod):
            self._start(stream)  # streaming calls run at once; unary ones on their message

    def message_arrived(self, stream: H2Stream) -> None:
        if not stream.started:
            self._start(stream)

    def _start(self, stream: H2Stream) -> None:
        stream.started = True
        assert self._calls is not None
        self._calls.start_soon(self._run_call, stream)

    async def _run_call(self, stream: H2Stream) -> None:
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
        status, message = GrpcStatus.OK, ""
        try:
            if isinstance(method, UnaryMethod) and stream.deadline is None:
                await self._answer_unary(stream, method)
            else:
                deadline = math.inf if stream.deadline is None else stream.deadline
                with trio.CancelScope(deadline=deadline) as scope:
                    stream.scope = scope
                    if isinstance(method, UnaryMethod):
                        await self._answer_unary(stream, method)
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
            self._finish_now(stream, status, message)

    async def _answer_unary(self, stream: H2Stream, method: UnaryMethod) -> None:
        data = stream.take()
        if data is None:
            raise GrpcError(GrpcStatus.INVALID_ARGUMENT, "the call carried no request message")
        reply = await method.handler(parse_message(method.request_type, data), stream)
        await self.send_reply(stream, reply)

    async def send_reply(self, stream: H2Stream, reply: Any) -> None:
        """One response message, in DATA frames the client's windows allow. A reply in
        parts (``_infer_wire.WireReply``) is written part by part, never joined."""
        parts: list[bytes | memoryview] = (
            reply.parts if isinstance(reply, WireReply) else [reply.SerializeToString()]
        )
        size = sum(map(len, parts))
        limit = self._max_message
        if size > limit:
            raise GrpcError(
                GrpcStatus.RESOURCE_EXHAUSTED, f"Sent message larger than max ({size} vs. {limit})"
            )
        flag = 0
        if stream.wbits_out is not None:
            parts, flag = [compress(b"".join(parts), stream.wbits_out)], 1
            size = len(parts[0])
        if not stream.headers_sent:
            stream.headers_sent = True
            self._queue_headers(stream.id, response_headers(stream.wbits_out), 0)
        prefix = MESSAGE_PREFIX.pack(flag, size)
        remaining = 5 + size
        if remaining <= min(stream.send_window, self._send_window, self._peer_max_frame):
            # The usual case: one DATA frame the windows allow as it is.
            stream.send_window -= remaining
            self._send_window -= remaining
            frame = (h2.frame_header(remaining, h2.DATA, 0, stream.id), prefix, *parts)
            self._outbox.extend(frame, h2.FRAME_HEADER_BYTES + remaining)
            remaining = 0
        parts.insert(0, prefix)
        while remaining:
            if stream.reset:
                raise ClientGone("the client reset the stream")
            count = min(remaining, stream.send_window, self._send_window, self._peer_max_frame)
            if count <= 0:
                self._outbox.flush()
                await self._window_opened.wait()
                continue
            stream.send_window -= count
            self._send_window -= count
            self._outbox.queue(h2.frame_header(count, h2.DATA, 0, stream.id))
            for part in _take(parts, count):
                self._outbox.queue(part)
            parts = trim(parts, count)
            remaining -= count
            if self._outbox.size > _OUTBOX_HIGH:
                self._outbox.flush()
                await self._outbox.drain()
        if not isinstance(stream.method, UnaryMethod):
            self._outbox.flush()  # a streamed message goes now; a unary one with its trailers

    def _finish_now(self, stream: H2Stream, status: GrpcStatus, message: str) -> None:
        """End the call: trailers (trailers-only before any response), then the stream."""
        if stream.local_closed:
            return
        block = trailers(status, message, stream.trailers, only=not stream.headers_sent)
        self._queue_headers(stream.id, block, h2.END_STREAM)
        stream.local_closed = True
        if not stream.remote_closed:
            # The answer is complete while the client still sends: tell it to stop.
            self._outbox.queue(h2.rst_stream(stream.id, h2.NO_ERROR))
        self._forget(stream)
        self._outbox.flush()

    def _answer_http(self, stream_id: int, block: bytes) -> None:
        """A plain HTTP answer to a request that is not a gRPC call."""
        self._queue_headers(stream_id, block, h2.END_STREAM)

    def _queue_headers(self, stream_id: int, block: bytes, flags: int) -> None:
        size = self._peer_max_frame
        if len(block) <= size:
            self._outbox.queue(h2.frame(h2.HEADERS, flags | h2.END_HEADERS, stream_id, block))
            return
        pieces = [block[at : at + size] for at in range(0, len(block), size)]
        self._outbox.queue(h2.frame(h2.HEADERS, flags, stream_id, pieces[0]))
        for piece in pieces[1:-1]:
            self._outbox.queue(h2.frame(h2.CONTINUATION, 0, stream_id, piece))
        self._outbox.queue(h2.frame(h2.CONTINUATION, h2.END_HEADERS, stream_id, pieces[-1]))

    def _reset_stream(self, stream_id: int, code: int, reason: str) -> None:
        self._stats.stream_errors += 1
        logger.debug("gRPC stream %d reset (%#x): %s", stream_id, code, reason)
        self._outbox.queue(h2.rst_stream(stream_id, code))
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._drop(stream)

    def _drop(self, stream: H2Stream) -> None:
        """The stream is gone without an answer (reset, or the connection ended)."""
        stream.reset = True
        stream.local_closed = True
        stream.wake()
        if stream.scope is not None:
            stream.scope.cancel()
        if stream.withdraw is not None:
            stream.withdraw()
        self._open_window()  # a sender waiting on its window must see the reset
        self._forget(stream)

    def _forget(self, stream: H2Stream) -> None:
        removed = self._streams.pop(stream.id, None) is not None
        if removed and not self._streams and self._draining:
            self._reader.cancel()

    # --- writing -------------------------------------------------------------------------

    def _opening_frames(self) -> bytes:
        limits = self._limits
        settings = h2.settings_frame(
            [
                (h2.ENABLE_PUSH, 0),
                (h2.MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams),
                (h2.INITIAL_WINDOW_SIZE, limits.stream_window_bytes),
                (h2.MAX_FRAME_SIZE, limits.max_frame_bytes),
                (h2.MAX_HEADER_LIST_SIZE, limits.max_header_list_bytes),
            ]
        )
        return settings + h2.window_update(0, limits.connection_window_bytes - h2.DEFAULT_WINDOW)

    def _open_window(self) -> None:
        self._window_opened.set()
        self._window_opened = trio.Event()

    def _fail(self) -> None:
        """The socket failed: nothing more can be sent, so the connection ends."""
        self._reader.cancel()
        for stream in list(self._streams.values()):
            self._drop(stream)


def _take(parts: list[bytes | memoryview], count: int) -> list[bytes | memoryview]:
    """The first ``count`` bytes of ``parts``, as views (no copy)."""
    taken: list[bytes | memoryview] = []
    for part in parts:
        if count <= 0:
            break
        if len(part) <= count:
            taken.append(part)
            count -= len(part)
        else:
            taken.append(memoryview(part)[:count])
            count = 0
    return taken
