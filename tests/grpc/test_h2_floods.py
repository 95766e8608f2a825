"""Floods on one connection while another connection's client is served: resets the
client provokes, PINGs from a client that never reads, a socket that never runs dry, a
large legal message. Each ends (GOAWAY) or is held (flow control, an unread socket)
with the server's memory bounded, and the probe on another connection is answered
meanwhile (within 5 s: generous under load; the release note has measured figures)."""

from __future__ import annotations

import socket
import struct
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import h2.errors
import pytest
import trio
import trio.testing

from trioserve.grpc import _h2_frames as frames
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.grpc._h2_guard import CoreStatistics
from trioserve.grpc._hpack import encode_headers
from trioserve.grpc._infer_wire import _encode_varint

MiB = 1024 * 1024
ECHO_BLOCK = encode_headers(
    [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/t.T/Echo"),
     (b":authority", b"a"), (b"content-type", b"application/grpc")]
)  # fmt: skip
PREFACE = frames.PREFACE + frames.settings_frame([])


def call_frames(h2c: Any, stream_id: int, message: bytes, *, end: bool = True) -> bytes:
    return h2c.raw_frame(frames.HEADERS, frames.END_HEADERS, stream_id, ECHO_BLOCK) + (
        h2c.raw_frame(frames.DATA, frames.END_STREAM if end else 0, stream_id, message)
    )


async def test_made_you_reset_flood_gets_goaway(h2c: Any) -> None:
    """Complete calls each followed by a WINDOW_UPDATE of 0 on its stream, which the
    server answers by resetting the stream: the resets it sends are capped as a
    client's own resets are."""
    statistics = CoreStatistics()
    message = h2c.grpc_message(pb.ModelInferRequest(model_name="x").SerializeToString())
    zero = h2c.raw_frame  # WINDOW_UPDATE of 0 on the call's stream
    flood = b"".join(
        call_frames(h2c, sid, message) + zero(frames.WINDOW_UPDATE, 0, sid, b"\0\0\0\0")
        for sid in range(1, 2 * 5000, 2)
    )
    async with (
        h2c.core_server(h2c.small_methods(), statistics=statistics) as port,
        await trio.open_tcp_stream("127.0.0.1", port) as stream,
    ):
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(h2c.send_until_closed, stream, PREFACE + flood)
                goaway = await h2c.next_frame(stream, frames.GOAWAY)
        assert goaway is not None
        assert struct.unpack(">LL", goaway[1][:8])[1] == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert statistics.calm_goaways == 1
        assert 1000 <= statistics.stream_errors < 1100  # the burst, and a little refill
        await h2c.probe(port)


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


async def test_ping_flood_from_a_client_that_never_reads_stops_the_reading(h2c: Any) -> None:
    """Each PING queues an ACK the client never reads: once the outbox holds
    ``max_outbox_bytes`` (4 MiB), the server reads no more of that client, so its memory
    stays at that (what it holds is counted by the core, not traced here: tracing each
    ACK's allocation would make this test take seconds)."""
    statistics = CoreStatistics()
    pings = PREFACE + h2c.raw_frame(frames.PING, 0, 0, b"12345678") * (4 * MiB)  # 68 MiB
    sent = trio.Event()

    async def flood(port: int) -> None:
        sock = trio.socket.socket()
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # small: no room for a flood
            sock.setsockopt(socket.SOL_SOCKET, option, 64 * 1024)
        await sock.connect(("127.0.0.1", port))
        async with trio.SocketStream(sock) as stream:
            await stream.send_all(pings)
            sent.set()
            await trio.sleep_forever()

    async with (
        h2c.core_server(h2c.small_methods(), statistics=statistics) as port,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(flood, port)
        await trio.testing.wait_all_tasks_blocked()
        # The server stopped reading: most of the PINGs are still unsent.
        assert not sent.is_set()
        assert statistics.outbox_pauses >= 1
        await h2c.probe(port)
        nursery.cancel_scope.cancel()


def traced_now() -> int:
    return tracemalloc.get_traced_memory()[0]


class Flood(threading.Thread):
    """Sends ``chunk`` over and over (after ``opening``) from a thread, as fast as the
    server reads, until ``stop`` is set or ``limit`` bytes are sent: a client whose
    socket never runs dry while the server works through what it sent."""

    def __init__(
        self, port: int, opening: bytes, chunk: bytes, limit: int, closing: bytes = b""
    ) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.opening = opening
        self.chunk = chunk
        self.limit = limit
        self.closing = closing
        self.stop = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.sock.sendall(self.opening)
            sent = 0
            while sent < self.limit and not self.stop.is_set():
                self.sock.sendall(self.chunk)
                sent += len(self.chunk)
            self.sock.sendall(self.closing)
        except OSError:
            pass
        finally:
            self.done.set()

    def read_until(self, marker: bytes) -> bytes:
        """What the server sent, up to ``marker`` (blocking: run it in a thread)."""
        received = b""
        while marker not in received:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            received += chunk
        return received

    def finish(self) -> None:
        self.stop.set()
        self.sock.shutdown(socket.SHUT_RDWR)
        self.join()
        self.sock.close()


async def test_a_socket_that_never_runs_dry_does_not_hold_up_other_clients(h2c: Any) -> None:
    # PRIORITY frames: legal, unanswered, unlimited, each worth a frame's work.
    chunk = h2c.raw_frame(frames.PRIORITY, 0, 1, b"\0\0\0\0\x10") * 65536
    async with h2c.core_server(h2c.small_methods()) as port:
        flood = Flood(port, PREFACE, chunk, limit=256 * MiB)
        flood.start()
        try:
            await h2c.probe(port)
            assert not flood.done.is_set()  # answered while the flood went on
        finally:
            flood.finish()


async def test_a_large_message_does_not_hold_up_other_clients(h2c: Any, traced: None) -> None:
    """A legal 64 MiB message, sent as fast as the server takes it: its buffer grows to
    its size and no further, and another client is served while it comes."""
    frames_of_zeros = 64
    zeros = h2c.raw_frame(frames.DATA, 0, 1, bytes(MiB))
    size = frames_of_zeros * MiB  # raw_input_contents: 64 MiB of zeros
    head = b"\x3a" + _encode_varint(size)  # field 7, length-delimited
    opening = (
        PREFACE
        + h2c.raw_frame(frames.HEADERS, frames.END_HEADERS, 1, ECHO_BLOCK)
        + h2c.raw_frame(frames.DATA, 0, 1, struct.pack(">BL", 0, len(head) + size) + head)
    )
    closing = h2c.raw_frame(frames.DATA, frames.END_STREAM, 1)
    windows = {"stream_window_bytes": 2**31 - 1, "connection_window_bytes": 2**31 - 1}
    async with h2c.core_server(h2c.small_methods(), **windows) as port:
        tracemalloc.reset_peak()
        before = traced_now()
        flood = Flood(port, opening, zeros, frames_of_zeros * len(zeros), closing)
        flood.start()
        try:
            await h2c.probe(port)
            assert not flood.done.is_set()  # answered while the message came
            answer = await trio.to_thread.run_sync(flood.read_until, b"grpc-status")
            assert str(len(head) + size).encode() in answer  # the size the handler saw
        finally:
            flood.finish()
        # The message, and the copy of it protobuf makes for the test's handler.
        assert tracemalloc.get_traced_memory()[1] - before < 2 * size + 8 * MiB
