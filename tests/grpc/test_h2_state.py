"""The HTTP/2 core's state machine without I/O (``_h2_state.H2State``): bytes passed by
hand between it and the ``h2`` package's client, a clock the test moves, no trio.

The socket-level tests (test_h2_core.py, test_h2_floods.py, ...) show the same
defences through the driver; these pin the state machine's own contract: what it
sends, the events it asks its driver to act on, and that whatever a client sends, only
a GOAWAY comes of it, with windows and buffers within their bounds.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve._limits import GrpcLimits
from trioserve.grpc import _h2_frames as frames
from trioserve.grpc._call import StreamMethod, UnaryMethod
from trioserve.grpc._errors import GrpcStatus
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.grpc._h2_guard import CoreStatistics
from trioserve.grpc._h2_state import OUTBOX_PARTS, YIELD_FRAMES, H2State, Signal
from trioserve.grpc._h2_stream import H2Stream
from trioserve.grpc._hpack import encode_headers
from trioserve.grpc._wire import MESSAGE_PREFIX, response_headers

LIVE = "/inference.GRPCInferenceService/ServerLive"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


async def _never(*args: Any) -> Any:
    raise AssertionError("the state machine runs no handler")


METHODS = {
    LIVE: UnaryMethod(pb.ServerLiveRequest, _never),
    STREAM: StreamMethod(pb.ModelInferRequest, _never),
}


def grpc_message(payload: bytes) -> bytes:
    return MESSAGE_PREFIX.pack(0, len(payload)) + payload


def raw_frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return frames.frame(kind, flags, stream_id, payload)


def call_headers(path: str = LIVE, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":authority", b"localhost"),
        (b":path", path.encode()),
        (b"content-type", b"application/grpc"),
        *extra,
    ]


def call_block(path: str = LIVE) -> bytes:
    """A call's header block, for frames written by hand."""
    return encode_headers(call_headers(path))


class Pair:
    """Our server state machine and h2's client, connected by hand."""

    def __init__(self, **limits: Any) -> None:
        self.now = 0.0
        self.statistics = CoreStatistics()
        self.limits = GrpcLimits(**limits)
        self.server = H2State(
            METHODS, self.limits, 4 * 1024 * 1024, self.statistics, clock=lambda: self.now
        )
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.client = h2.connection.H2Connection(config)
        self.client.initiate_connection()
        self.client_events: list[h2.events.Event] = []
        self.ready: list[H2Stream] = []
        self.signals: list[Signal] = []
        self.exchange()

    def send(self, data: bytes) -> None:
        """Bytes to the server, the backlog handled as the driver would."""
        self.server.receive_data(data)
        while self.server.backlog:
            self.server.receive_data(b"")
        self._take_events()

    def exchange(self) -> None:
        """Pass bytes both ways until neither side has any to send."""
        while True:
            sent = self.client.data_to_send()
            if sent:
                self.send(sent)
            answer = self.server.out.take()
            if answer:
                self.client_events += self.client.receive_data(answer)
            if not sent and not answer:
                return

    def _take_events(self) -> None:
        for event in self.server.events:
            if isinstance(event, Signal):
                self.signals.append(event)
            else:
                self.ready.append(event)
        self.server.events.clear()

    def answer(self, stream: H2Stream, payload: bytes) -> None:
        """What a call's run does with a reply that fits the windows, then OK."""
        sender = self.server.sender
        sender.queue_headers(stream.id, response_headers(None), 0)
        stream.headers_sent = True
        assert sender.queue_message(stream, [grpc_message(payload)], 5 + len(payload)) == []
        self.server.finish(stream, GrpcStatus.OK, "")
        self._take_events()

    def of_client(self, kind: type[h2.events.Event]) -> list[Any]:
        return [event for event in self.client_events if isinstance(event, kind)]

    def goaway(self) -> tuple[int, int]:
        """The server's GOAWAY, read by hand (h2 refuses to parse after some errors)."""
        data = self.server.out.take()
        at = data.rindex(bytes([frames.GOAWAY, 0, 0, 0, 0, 0]))
        last, code = struct.unpack_from(">LL", data, at + 6)
        return last, code


def test_a_unary_call_is_ready_when_its_message_is_complete_and_answered_in_order():
    pair = Pair()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, call_headers(), end_stream=False)
    pair.exchange()
    assert pair.ready == []  # no message yet
    assert pair.signals == [Signal.BUSY]
    pair.client.send_data(sid, grpc_message(b""), end_stream=True)
    pair.exchange()
    [stream] = pair.ready
    assert stream.take() == b""
    pair.answer(stream, b"\x08\x01")
    pair.exchange()
    [response] = pair.of_client(h2.events.ResponseReceived)
    assert dict(response.headers)[b":status"] == b"200"
    [data] = pair.of_client(h2.events.DataReceived)
    assert data.data == grpc_message(b"\x08\x01")
    [trailers] = pair.of_client(h2.events.TrailersReceived)
    assert dict(trailers.headers)[b"grpc-status"] == b"0"
    assert pair.signals == [Signal.BUSY, Signal.IDLE]
    assert pair.server.streams == {}


def test_a_unary_call_ended_without_its_message_still_runs_to_be_answered():
    pair = Pair()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, call_headers(), end_stream=False)
    pair.client.end_stream(sid)  # an empty DATA frame: END_STREAM and no message
    pair.exchange()
    [stream] = pair.ready
    assert stream.take() is None  # its run answers INVALID_ARGUMENT


def test_a_streaming_call_is_ready_at_its_headers_and_its_deadline_is_the_clocks():
    pair = Pair()
    pair.now = 100.0
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, call_headers(STREAM, (b"grpc-timeout", b"250m")))
    pair.exchange()
    [stream] = pair.ready
    assert stream.deadline == pytest.approx(100.25)


def test_settings_and_pings_are_acknowledged():
    pair = Pair()
    assert pair.of_client(h2.events.SettingsAcknowledged)
    pair.client.ping(b"12345678")
    pair.exchange()
    [ack] = pair.of_client(h2.events.PingAckReceived)
    assert ack.ping_data == b"12345678"
    remote = pair.client.remote_settings
    assert remote.max_concurrent_streams == pair.limits.max_concurrent_streams
    assert remote.initial_window_size == pair.limits.stream_window_bytes


def test_the_connection_window_is_credited_back_at_half_and_never_overdrawn():
    pair = Pair(connection_window_bytes=1 << 20, stream_window_bytes=1 << 20)
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, call_headers(STREAM))
    pair.exchange()
    [stream] = pair.ready
    chunk = grpc_message(b"x" * 60_000)
    sent = 0
    for _ in range(12):
        pair.client.send_data(sid, chunk)
        sent += len(chunk)
        pair.exchange()
        while stream.take() is not None:  # the call keeps up
            pass
        pair.exchange()
        assert pair.server.recv_window >= 0
    updates = [e for e in pair.of_client(h2.events.WindowUpdated) if e.stream_id == 0]
    assert sum(e.delta for e in updates) >= sent - (1 << 19)  # credited at half


def test_data_beyond_the_connection_window_is_a_flow_control_error():
    # Requests nobody takes hold the window shut (``max_pending_bytes``), so the client's
    # fourth full frame is one byte beyond the 65,535 it was given.
    pair = Pair(connection_window_bytes=65_535, max_pending_bytes=1000)
    pair.send(raw_frame(frames.HEADERS, frames.END_HEADERS, 1, call_block(STREAM)))
    full = raw_frame(frames.DATA, 0, 1, grpc_message(b"\0" * (16_384 - 5)))
    pair.send(full * 3)
    assert not pair.server.ended
    pair.send(full)
    assert pair.server.ended
    assert pair.goaway() == (1, frames.FLOW_CONTROL_ERROR)
    assert pair.statistics.protocol_errors == 1


def test_queued_requests_hold_the_connection_window_until_taken():
    pair = Pair(max_pending_bytes=60_000, connection_window_bytes=200_000)
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, call_headers(STREAM))
    pair.exchange()
    pair.client_events.clear()  # the opening window update
    [stream] = pair.ready
    for _ in range(3):
        pair.client.send_data(sid, grpc_message(b"y" * 50_000))
        pair.exchange()
    assert pair.server.pending.full
    reopened = sum(e.delta for e in pair.of_client(h2.events.WindowUpdated) if e.stream_id == 0)
    assert reopened == 0  # past the budget, the window stays shut
    while stream.take() is not None:
        pass
    pair.exchange()
    assert sum(e.delta for e in pair.of_client(h2.events.WindowUpdated) if e.stream_id == 0)


def test_continuation_frames_are_capped():
    pair = Pair(max_continuation_frames=8)
    flood = raw_frame(frames.HEADERS, 0, 1, call_block()[:3])
    flood += raw_frame(frames.CONTINUATION, 0, 1) * 9
    pair.send(flood)
    assert pair.server.ended
    assert pair.goaway()[1] == frames.ENHANCE_YOUR_CALM
    assert pair.statistics.continuation_floods == 1


def test_a_header_block_over_its_bytes_is_refused_before_it_is_kept():
    pair = Pair(max_header_list_bytes=1024)
    pair.send(raw_frame(frames.HEADERS, 0, 1, b"\0" * 2000))
    pair.send(raw_frame(frames.CONTINUATION, 0, 1, b"\0" * 100))
    assert pair.goaway()[1] == frames.ENHANCE_YOUR_CALM


def open_and_reset(pair: Pair, count: int) -> None:
    for _ in range(count):
        sid = pair.client.get_next_available_stream_id()
        pair.client.send_headers(sid, call_headers(STREAM))
        pair.client.reset_stream(sid)
        pair.send(pair.client.data_to_send())


def test_rapid_reset_ends_the_connection_and_time_refills_the_budget():
    pair = Pair(max_reset_burst=10, resets_per_s=1.0)
    open_and_reset(pair, 10)
    assert not pair.server.ended
    pair.now += 5.0  # five resets' worth
    open_and_reset(pair, 5)
    assert not pair.server.ended
    open_and_reset(pair, 1)
    assert pair.server.ended
    assert pair.goaway()[1] == frames.ENHANCE_YOUR_CALM
    assert pair.statistics.calm_goaways == 1


def test_resets_the_server_is_made_to_send_draw_on_the_same_budget():
    pair = Pair(max_reset_burst=5, resets_per_s=0.001)
    for sid in range(1, 13, 2):
        pair.send(raw_frame(frames.HEADERS, frames.END_HEADERS, sid, call_block(STREAM)))
        pair.send(raw_frame(frames.WINDOW_UPDATE, 0, sid, b"\0\0\0\0"))  # a stream error
    assert pair.statistics.stream_errors == 6  # the sixth is one too many
    assert pair.server.ended
    assert pair.goaway()[1] == frames.ENHANCE_YOUR_CALM


def test_streams_over_the_limit_are_refused():
    pair = Pair(max_concurrent_streams=2)
    for sid in (1, 3, 5):
        pair.send(raw_frame(frames.HEADERS, frames.END_HEADERS, sid, call_block(STREAM)))
    assert sorted(pair.server.streams) == [1, 3]
    assert pair.statistics.refused_streams == 1
    assert frames.rst_stream(5, frames.REFUSED_STREAM) in pair.server.out.take()


def test_header_blocks_remembered_are_bounded_in_bytes_and_counted_on_close():
    pair = Pair(hpack_cache_bytes=20_000)
    for index, sid in enumerate(range(1, 80, 2)):  # 40 distinct 2 KB blocks
        value = b"%04d" % index * 500
        block = encode_headers([*call_headers(STREAM), (b"x-value", value)])
        pair.send(raw_frame(frames.HEADERS, frames.END_HEADERS, sid, block))
        pair.send(raw_frame(frames.RST_STREAM, 0, sid, b"\0\0\0\x08"))
        pair.now += 1.0  # within the reset budget
        assert pair.server._decoder.cache.size <= 20_000
        assert pair.server._plans._cache.size <= 20_000
    assert not pair.server.ended
    pair.server.close()
    assert pair.statistics.hpack_cache_evictions > 0


def test_unread_acknowledgements_backlog_the_connection():
    pair = Pair()
    pings = raw_frame(frames.PING, 0, 0, b"p" * 8) * (OUTBOX_PARTS + 1)
    pair.server.receive_data(pings)
    assert pair.server.backlog  # stopped after YIELD_FRAMES frames
    assert len(pair.server.out.parts) == YIELD_FRAMES
    while pair.server.backlog:
        pair.server.receive_data(b"")
    assert pair.server.backlogged  # the driver reads no more until the ACKs are sent
    pair.server.out.take()
    assert not pair.server.backlogged


def test_a_large_message_can_be_received_straight_into_its_buffer():
    pair = Pair(stream_window_bytes=1 << 20, connection_window_bytes=1 << 20)
    payload = bytes(range(256)) * 1024  # 256 KiB
    message = grpc_message(payload)
    head = raw_frame(frames.HEADERS, frames.END_HEADERS, 1, call_block())
    data_header = frames.frame_header(len(message[:200_000]), frames.DATA, 0, 1)
    pair.send(head + data_header + message[:1000])
    view = pair.server.direct_view()
    assert view is not None and len(view) == 200_000 - 1000
    view[:] = message[1000:200_000]
    pair.server.received_directly(view, len(view))
    pair.send(raw_frame(frames.DATA, frames.END_STREAM, 1, message[200_000:]))
    [stream] = pair.ready
    assert bytes(stream.take() or b"") == payload


def test_bytes_received_for_a_stream_answered_meanwhile_are_dropped():
    pair = Pair(stream_window_bytes=1 << 20, connection_window_bytes=1 << 20)
    message = grpc_message(bytes(200_000))
    head = raw_frame(frames.HEADERS, frames.END_HEADERS, 1, call_block(STREAM))
    pair.send(head + frames.frame_header(len(message), frames.DATA, 0, 1) + message[:10])
    [stream] = pair.ready
    view = pair.server.direct_view()
    assert view is not None
    pair.server.finish(stream, GrpcStatus.OK, "")  # its call ended while we received
    came = len(view)
    view[:] = message[10 : 10 + came]
    pair.server.received_directly(view, came)
    pair.send(message[10 + came :])
    assert stream.messages == deque()
    assert pair.server.pending.queued == 0


def test_idle_ticks_end_a_connection_with_no_stream_and_count_it():
    pair = Pair()
    pair.server.idle_tick(3)
    pair.server.idle_tick(3)
    assert not pair.server.ended
    pair.server.idle_tick(3)
    assert pair.server.ended
    assert Signal.ENDED in pair.server.events
    pair.server.close()
    assert pair.goaway() == (0, frames.NO_ERROR)
    assert pair.statistics.idle_closed == 1


def test_a_drain_ends_once_the_last_stream_is_answered():
    pair = Pair()
    sid = pair.client.get_next_available_stream_id()
    pair.client.send_headers(sid, call_headers(), end_stream=False)
    pair.client.send_data(sid, grpc_message(b""), end_stream=True)
    pair.exchange()
    pair.server.begin_shutdown()
    assert not pair.server.ended
    pair.answer(pair.ready[0], b"")
    assert pair.server.ended
    assert Signal.ENDED in pair.signals


# --- whatever a client sends ----------------------------------------------------------

_KINDS = [
    frames.DATA, frames.HEADERS, frames.PRIORITY, frames.RST_STREAM, frames.SETTINGS,
    frames.PUSH_PROMISE, frames.PING, frames.GOAWAY, frames.WINDOW_UPDATE,
    frames.CONTINUATION, 0xFA,
]  # fmt: skip
_PAYLOADS = {
    frames.DATA: st.one_of(
        st.binary(max_size=64),
        st.builds(grpc_message, st.binary(max_size=64)),
        st.builds(lambda n: MESSAGE_PREFIX.pack(0, n), st.integers(0, 2**32 - 1)),
    ),
    frames.HEADERS: st.one_of(
        st.sampled_from([call_block(), call_block(STREAM), call_block("/no/such")]),
        st.binary(max_size=64),
    ),
    frames.SETTINGS: st.lists(
        st.tuples(st.integers(0, 8), st.integers(0, 2**32 - 1)), max_size=3
    ).map(lambda pairs: b"".join(struct.pack(">HL", k, v) for k, v in pairs)),
    frames.WINDOW_UPDATE: st.integers(0, 2**32 - 1).map(lambda n: struct.pack(">L", n)),
    frames.RST_STREAM: st.integers(0, 15).map(lambda n: struct.pack(">L", n)),
    frames.PING: st.binary(min_size=8, max_size=8),
}
_FRAME = st.sampled_from(_KINDS).flatmap(
    lambda kind: st.builds(
        raw_frame,
        st.just(kind),
        st.sampled_from([0, 0x1, 0x4, 0x5, 0x8, 0x20, 0x2D]),
        st.sampled_from([0, 1, 3, 5, 2, 99]),
        _PAYLOADS.get(kind, st.binary(max_size=16)),
    )
)


@given(
    sequence=st.lists(_FRAME, max_size=40),
    cuts=st.lists(st.integers(1, 64), max_size=20),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_frame_sequence_ends_in_goaway_at_worst_within_bounds(sequence, cuts):
    pair = Pair(max_concurrent_streams=3, max_reset_burst=6, stream_window_bytes=65_535)
    data = b"".join(sequence)
    pieces = []
    for cut in cuts:  # delivered in arbitrary pieces
        pieces.append(data[:cut])
        data = data[cut:]
    pieces.append(data)
    server = pair.server
    for piece in pieces:
        pair.send(piece)  # raises nothing, whatever the bytes
        assert server.recv_window >= 0
        assert all(stream.recv_window >= 0 for stream in server.streams.values())
        assert len(server.streams) <= 3
        assert len(server._buf) - server._pos <= frames.FRAME_HEADER_BYTES + 16_384
        assert server.pending.queued >= 0
        for ready in pair.ready:  # the calls take what they were given
            while ready.take() is not None:
                pass
        pair.ready.clear()
    sent = server.out.take()
    if server.ended and pair.statistics.protocol_errors:
        assert bytes([frames.GOAWAY]) in sent
    server.close()
    assert server.streams == {}


_ACTIONS = st.lists(
    st.sampled_from(["call", "stream", "message", "end", "reset", "ping", "window", "settings"]),
    max_size=30,
)


@given(actions=_ACTIONS)
@settings(max_examples=150, deadline=None)
def test_a_well_behaved_client_sees_only_valid_http2(actions):
    pair = Pair(max_concurrent_streams=4)
    client = pair.client
    open_ids: list[int] = []
    for action in actions:
        try:
            if action in ("call", "stream") and len(open_ids) < 4:
                sid = client.get_next_available_stream_id()
                client.send_headers(sid, call_headers(LIVE if action == "call" else STREAM))
                open_ids.append(sid)
            elif action == "message" and open_ids:
                client.send_data(open_ids[-1], grpc_message(b"\x08\x01"))
            elif action == "end" and open_ids:
                client.end_stream(open_ids.pop(0))
            elif action == "reset" and open_ids:
                client.reset_stream(open_ids.pop())
            elif action == "ping":
                client.ping(b"01234567")
            elif action == "window":
                client.increment_flow_control_window(1000)
            elif action == "settings":
                client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 70_000})
        except (h2.exceptions.StreamClosedError, h2.exceptions.FlowControlError):
            continue  # the server ended that stream first: the client knows it now
        pair.exchange()  # h2 raises if the server ever sends what HTTP/2 forbids
        for stream in pair.ready:
            if stream.id in pair.server.streams:
                pair.answer(stream, b"")
        pair.ready.clear()
        pair.exchange()
        open_ids = [sid for sid in open_ids if sid in pair.server.streams]
    assert not pair.server.ended
    assert pair.statistics.protocol_errors == 0
