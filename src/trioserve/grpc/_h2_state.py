"""The state of one server-side HTTP/2 connection carrying gRPC calls (RFC 9113), with no
I/O: bytes in (``receive_data``), bytes out (``out``) and events for the driver
(``events``). Everything that affects the protocol's state lives here, as h11 keeps it:
settings, both sides' flow-control windows, header blocks and HPACK, stream states, and
every bound a client may push against. ``_h2_connection`` is the trio driver around it:
it reads, sends, and runs the calls the events start. Tests drive it by hand
(tests/grpc/test_h2_state.py).

Defences (tests in tests/grpc/test_h2_*.py), each bound a ``GrpcLimits`` field; what
they count is ``_h2_guard.CoreStatistics``:
* frames of unknown type are ignored; malformed ones end the stream or the connection
  with the code RFC 9113 gives (``GoawayError`` becomes GOAWAY and ``ended``, and
  nothing else escapes ``receive_data``);
* MAX_CONCURRENT_STREAMS is enforced (REFUSED_STREAM); resets either side sends and
  refused streams draw on ``_h2_guard.ResetBudget``; header blocks are bounded in bytes
  and frames (``HeaderBlock``), the HPACK cache in bytes;
* a message is refused by its declared length and buffered as it arrives (``_h2_stream``);
* requests queued or unanswered are bounded per connection (``PendingBudget``): past it
  the connection window is not reopened;
* ``backlogged``: past ``max_outbox_bytes`` or ``OUTBOX_PARTS`` unsent (a client that
  never reads its PING or SETTINGS ACKs) the driver stops reading;
* at most ``YIELD_FRAMES`` frames are handled per ``receive_data``, the rest is
  ``backlog`` for the next call, so the driver can let other tasks run;
* a stream's buffers go the moment it ends, a connection's when it closes;
* ``idle_tick`` counts the sweeper's ticks with no stream open (idle close), and
  ``close_idle`` lets an idle connection give way to a new one.
"""

from __future__ import annotations

from . import _h2_frames as h2
from ._h2_guard import count, header_fragment
from ._h2_stream import H2Stream
from ._h2_streams import BUSY, ENDED, IDLE, REPAID, WINDOW_OPENED, Event, H2Streams, Signal, logger

__all__ = [
    "BUSY", "ENDED", "IDLE", "REPAID", "WINDOW_OPENED", "Event", "H2State", "Signal",
]  # fmt: skip

YIELD_FRAMES = 1024
# Parts the outbox may hold before the reader waits, whatever their bytes: each is an
# object, and a flood of PINGs queues 17-byte ACKs, 250,000 of them in 4 MiB.
OUTBOX_PARTS = 16 * 1024

_PREFACE, _SETTINGS, _FRAME, _DATA, _SKIP = range(5)  # what the parser reads next
_HEADER_BYTES = h2.FRAME_HEADER_BYTES
_DATA_FRAME = h2.DATA
_unpack_header = h2.HEADER.unpack_from


class H2State(H2Streams):
    # The parser: unread bytes (``_buf`` from ``_pos``), and within a DATA frame the
    # payload and padding still to come, for ``_data_stream`` (None: dropped). Each
    # instance sets its own as they change.
    _mode = _PREFACE
    _buf = b""
    _pos = 0
    _data_left = 0
    _pad_left = 0
    _data_flags = 0
    _data_stream: H2Stream | None = None
    backlog = False  # bytes received and not parsed yet (``YIELD_FRAMES``)
    # The server's SETTINGS went out already, as the socket was accepted (``_admission``
    # greets gRPC clients so that they call at once); else they answer the preface.
    opening_sent = False
    closed_as: str | None = None  # the counter of an idle connection's close
    # Idle detection (``idle_tick``): how many ticks have passed with no call open and
    # none opened.
    _seen_opened = 0
    _idle_ticks = 0

    # --- what the driver tells it --------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes from the client, in order; b"" goes on with the ``backlog``."""
        if self.ended:
            return
        if data:  # else the backlog is parsed where it stands, uncopied
            if self._pos < len(self._buf):
                self._buf = self._buf[self._pos :] + data
            else:
                self._buf = data
            self._pos = 0
        self.backlog = False
        try:
            self._parse()
        except h2.GoawayError as exc:
            self._connection_error(exc)

    def direct_view(self) -> memoryview | None:
        """Where the next received bytes may go straight into a message's buffer (one
        copy less for large messages), if the parser is inside such a DATA payload with
        nothing buffered; then ``received_directly`` says how much came."""
        stream = self._data_stream
        if self._mode != _DATA or stream is None or self._pos < len(self._buf):
            return None
        if stream.local_closed:
            return None
        return stream.direct_view(self._data_left)

    def received_directly(self, view: memoryview, received: int) -> None:
        stream = self._data_stream
        assert stream is not None
        self._data_left -= received
        if stream.local_closed:  # answered while the bytes came: they are dropped
            stream.received_directly(view, 0)
            self._data_stream = None
        else:
            self._data_stream = self._fed(stream, view, received)
        try:
            self._parse()
        except h2.GoawayError as exc:
            self._connection_error(exc)

    @property
    def backlogged(self) -> bool:
        """The client leaves what we sent unread: read no more until it is sent."""
        out = self.out
        return out.size > self._limits.max_outbox_bytes or len(out.parts) > OUTBOX_PARTS

    def begin_shutdown(self) -> None:
        """Drain: GOAWAY now (no new streams), end once the open ones are done."""
        if self.draining:
            return
        self.draining = True
        self.out.queue(h2.goaway(self.last_stream_id, h2.NO_ERROR))
        if not self.streams:
            self._end()

    def idle_tick(self, limit: int) -> None:
        """One tick of the server's sweeper: end the connection once it has had no
        call open for ``limit`` ticks in a row. (Counting beats a deadline per call:
        moving a cancel scope's deadline costs more than the rest of opening a call.)"""
        if self.streams or self._opened != self._seen_opened:
            self._seen_opened = self._opened
            self._idle_ticks = 0
            return
        self._idle_ticks += 1
        if self._idle_ticks >= limit:
            self.close_idle("idle_closed")

    def close_idle(self, counter: str) -> None:
        """End with GOAWAY(NO_ERROR) if no call is open, counted in ``counter``."""
        if not self.streams and not self.draining and not self.ended:
            self.closed_as = counter
            self._end()

    def close(self) -> None:
        """The driver reads no more: streams still open are gone; an idle close says
        GOAWAY. Then let go of what the client made the connection keep, at once rather
        than when the collector finds the connection's reference cycles."""
        if self.closed_as is not None:
            count(self._stats, self.closed_as)
            self.out.queue(h2.goaway(self.last_stream_id, h2.NO_ERROR, b"idle"))
            self.closed_as = None
        for stream in list(self.streams.values()):
            self.drop(stream)
        self.ended = True
        self._stats.hpack_cache_evictions += self._decoder.cache.evictions + self._plans.evictions
        self._stats.pending_pauses += self.pending.pauses
        self.pending.pauses = 0
        self._decoder.cache.clear()
        self._plans.clear()
        self._block.clear()
        self._buf = b""
        self._data_stream = None

    # --- reading -------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._buf
        pos = self._pos
        frames = 0
        max_frame = self._limits.max_frame_bytes
        block = self._block
        while True:
            mode = self._mode
            if mode != _FRAME:
                self._pos = pos
                if mode == _DATA:  # the usual: a DATA payload
                    if not self._data_payload() or self.ended:
                        return
                elif not self._between_frames():
                    return
                buf, pos = self._buf, self._pos
                continue
            if len(buf) - pos < _HEADER_BYTES:
                self._pos = pos
                return
            if frames == YIELD_FRAMES:
                self._pos = pos
                self.backlog = True
                return
            frames += 1
            high, low, kind, flags, stream_id = _unpack_header(buf, pos)
            length = high << 16 | low
            stream_id &= 0x7FFFFFFF
            if length > max_frame:
                raise h2.GoawayError(h2.FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            if kind == _DATA_FRAME:
                if flags & h2.PADDED and len(buf) - pos == _HEADER_BYTES and length:
                    self._pos = pos
                    return  # the pad length has not come yet
                self._data_frame(buf, pos + _HEADER_BYTES, length, flags, stream_id)
                buf, pos = self._buf, self._pos
                continue
            if block.open and kind != h2.CONTINUATION:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "a header block was interrupted")
            if kind > h2.CONTINUATION:  # an extension frame: skip it unread
                pos += _HEADER_BYTES
                self._pad_left = length
                self._mode = _SKIP
                continue
            if kind == h2.HEADERS or kind == h2.CONTINUATION:
                block.check(length)
            end = pos + _HEADER_BYTES + length
            if end > len(buf):
                self._pos = pos
                return  # the payload has not all come: parse the header again then
            payload = buf[pos + _HEADER_BYTES : end]
            pos = end
            self._pos = pos
            try:
                self._on_frame(kind, flags, stream_id, payload)
            except h2.StreamError as exc:
                self._reset_stream(exc.stream_id, exc.code, exc.reason)
            if self.ended:
                return

    def _between_frames(self) -> bool:
        """The parser's rarer states: the preface, the first frame (SETTINGS), skipped
        bytes. False until more bytes come."""
        mode = self._mode
        buf, pos = self._buf, self._pos
        if mode == _SKIP:
            take = min(len(buf) - pos, self._pad_left)
            self._pos = pos + take
            self._pad_left -= take
            if self._pad_left:
                return False
            self._mode = _FRAME
        elif mode == _PREFACE:
            got = buf[: len(h2.PREFACE)]
            if not h2.PREFACE.startswith(got):
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            if len(got) < len(h2.PREFACE):
                return False
            self._pos = len(h2.PREFACE)
            self._mode = _SETTINGS
            if not self.opening_sent:
                self.out.queue(h2.opening_frames(self._limits))
        else:  # _SETTINGS: the preface ends in the client's SETTINGS
            if len(buf) - pos < _HEADER_BYTES:
                return False
            if buf[pos + 3] != h2.SETTINGS:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "the preface must end in SETTINGS")
            self._mode = _FRAME
        return True

    def _data_frame(self, buf: bytes, pos: int, length: int, flags: int, stream_id: int) -> None:
        if stream_id == 0:
            raise h2.GoawayError(h2.PROTOCOL_ERROR, "DATA on stream 0")
        if self._block.open:
            raise h2.GoawayError(h2.PROTOCOL_ERROR, "a header block was interrupted")
        if length > self.recv_window:
            raise h2.GoawayError(h2.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self.recv_window -= length
        self._unacked += length
        body = length
        padding = 0
        if flags & h2.PADDED:
            if length == 0:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "padded DATA without a pad length")
            padding = buf[pos]
            pos += 1
            body = length - 1 - padding
            if body < 0:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "padding longer than the frame")
        self._pos = pos
        self._mode = _DATA
        self._data_left = body
        self._pad_left = padding
        self._data_flags = flags
        self._data_stream = self._receiving(stream_id, length)

    def _data_payload(self) -> bool:
        """Hand a DATA frame's payload to its stream as it comes; False until it all did."""
        buf, pos = self._buf, self._pos
        take = min(len(buf) - pos, self._data_left)
        if take:
            stream = self._data_stream
            if stream is not None and not stream.local_closed:  # not answered meanwhile
                self._data_stream = self._fed(stream, memoryview(buf)[pos : pos + take], 0)
            pos += take
            self._data_left -= take
        take = min(len(buf) - pos, self._pad_left) if not self._data_left else 0
        pos += take
        self._pad_left -= take
        self._pos = pos
        if self._data_left or self._pad_left:
            return False
        stream = self._data_stream
        self._data_stream = None
        self._mode = _FRAME
        if stream is not None and self._data_flags & h2.END_STREAM:
            self._end_remote(stream)
        self._reopen_window()
        return True

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == h2.HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == h2.CONTINUATION:
            block = self._block.add(flags, stream_id, payload)
            if block is not None:
                self._on_header_block(self._block.flags, stream_id, block)
        elif kind == h2.SETTINGS:
            if stream_id:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & h2.ACK:
                if self.sender.on_settings(payload, self.streams.values()):
                    self.events.append(WINDOW_OPENED)
            elif payload:
                raise h2.GoawayError(h2.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
        elif kind == h2.WINDOW_UPDATE:
            self.sender.on_window_update(stream_id, payload, self.streams, self.last_stream_id)
            self.events.append(WINDOW_OPENED)
        elif kind == h2.PING:
            if stream_id:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise h2.GoawayError(h2.FRAME_SIZE_ERROR, "PING payload is not 8 bytes")
            if not flags & h2.ACK:
                self.out.queue(h2.ping_ack(payload))
        elif kind == h2.RST_STREAM:
            self._on_rst_stream(stream_id, payload)
        elif kind == h2.PRIORITY:
            if stream_id == 0:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise h2.StreamError(stream_id, h2.FRAME_SIZE_ERROR, "PRIORITY is not 5 bytes")
        elif kind == h2.GOAWAY:
            if stream_id:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "GOAWAY on a stream")
            self.draining = True  # the client opens no more streams
            if not self.streams:
                self._end()
        elif kind == h2.PUSH_PROMISE:
            raise h2.GoawayError(h2.PROTOCOL_ERROR, "a client may not push")

    def _on_rst_stream(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise h2.GoawayError(h2.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise h2.GoawayError(h2.FRAME_SIZE_ERROR, "RST_STREAM is not 4 bytes")
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise h2.GoawayError(h2.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            return
        self.drop(stream)
        self._resets.charge()

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise h2.GoawayError(h2.PROTOCOL_ERROR, "HEADERS on an invalid stream id")
        fragment = header_fragment(flags, payload)
        if flags & h2.END_HEADERS:
            self._on_header_block(flags, stream_id, fragment)
        else:
            self._block.begin(flags, stream_id, fragment)

    def _connection_error(self, exc: h2.GoawayError) -> None:
        self._stats.protocol_errors += 1
        if exc.counter is not None:
            count(self._stats, exc.counter)
        logger.debug("gRPC connection error %#x: %s", exc.code, exc.reason)
        self.out.queue(h2.goaway(self.last_stream_id, exc.code, exc.reason.encode()))
        self._end()
