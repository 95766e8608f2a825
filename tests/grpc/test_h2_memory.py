"""What a client can make one HTTP/2 connection hold, measured with tracemalloc: a
message's buffer follows the bytes that arrived, not its declared length; a header
block's CONTINUATION frames are capped; the HPACK cache is bounded in bytes; and all of
it goes with the connection (the collector is off, as between ``trioserve run``'s timed
collections, so nothing waits on it)."""

from __future__ import annotations

import gc
import struct
import tracemalloc
from collections.abc import Iterator
from typing import Any

import h2.errors
import pytest
import trio
import trio.testing

from trioserve.grpc import _h2_frames as frames
from trioserve.grpc._h2_guard import CoreStatistics
from trioserve.grpc._hpack import encode_headers

MiB = 1024 * 1024


@pytest.fixture
def traced() -> Iterator[None]:
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
        gc.enable()


def traced_now() -> int:
    """The bytes traced now, less what the tests' own code allocated: the payloads a test
    sends may outlive its connection in the test's frames (Python 3.13 keeps one in an
    exception's traceback), and are no memory of the server's."""
    snapshot = tracemalloc.take_snapshot()
    server = snapshot.filter_traces([tracemalloc.Filter(False, "*/tests/*")])
    return sum(statistic.size for statistic in server.statistics("filename"))


async def ping_answered(stream: trio.SocketStream, h2c: Any) -> None:
    """Every frame sent before has been handled: the server answers in order."""
    await stream.send_all(h2c.raw_frame(frames.PING, 0, 0, b"in order"))
    assert await h2c.next_frame(stream, frames.PING) == (0, b"in order")


async def raw_connection(port: int) -> trio.SocketStream:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(frames.PREFACE + frames.settings_frame([]))
    return stream


def request_block(path: str, *extra: tuple[bytes, bytes]) -> bytes:
    """Literals that leave the dynamic table alone: blocks the decoder may remember."""
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
               (b":authority", b"a"), (b"content-type", b"application/grpc")]  # fmt: skip
    return encode_headers([*headers, *extra])


async def test_a_declared_length_costs_nothing_until_its_bytes_come(h2c: Any, traced: None) -> None:
    async with h2c.core_server(h2c.small_methods(), max_message_bytes=64 * MiB) as port:
        before = traced_now()
        async with await raw_connection(port) as stream:
            # A message declaring 64 MiB, of which 10 bytes come.
            block = request_block("/t.T/Echo")
            head = h2c.raw_frame(frames.HEADERS, frames.END_HEADERS, 1, block)
            prefix = struct.pack(">BL", 0, 64 * MiB) + b"0123456789"
            await stream.send_all(head + h2c.raw_frame(frames.DATA, 0, 1, prefix))
            await ping_answered(stream, h2c)
            assert traced_now() - before < MiB
        await trio.testing.wait_all_tasks_blocked()
        assert traced_now() - before < 256 * 1024


async def test_a_continuation_flood_gets_goaway_and_leaves_nothing_behind(
    h2c: Any, traced: None
) -> None:
    statistics = CoreStatistics()
    async with h2c.core_server(h2c.small_methods(), statistics=statistics) as port:
        before = traced_now()
        # 100 KB of header block in a HEADERS frame, then empty CONTINUATIONs without end.
        flood = h2c.raw_frame(frames.HEADERS, 0, 1, b"\x00" * 100_000) + b"".join(
            h2c.raw_frame(frames.CONTINUATION, 0, 1) for _ in range(100_000)
        )
        async with await raw_connection(port) as stream:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(h2c.send_until_closed, stream, flood)
                    goaway = await h2c.next_frame(stream, frames.GOAWAY)
        assert goaway is not None
        assert struct.unpack(">LL", goaway[1][:8])[1] == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        assert statistics.continuation_floods == 1
        await h2c.probe(port)
        del flood
        await trio.testing.wait_all_tasks_blocked()
        assert traced_now() - before < 256 * 1024


async def test_the_hpack_cache_is_bounded_in_bytes_and_goes_with_the_connection(
    h2c: Any, traced: None
) -> None:
    async with h2c.core_server(h2c.small_methods()) as port:
        before = traced_now()
        async with await raw_connection(port) as stream:
            # 128 calls, each with its own 60 KB value.
            for call in range(128):
                sid = 2 * call + 1
                value = b"%06d" % call * 10_000
                block = request_block("/t.T/Echo", (b"x-big", value))
                await stream.send_all(
                    h2c.raw_frame(frames.HEADERS, frames.END_HEADERS, sid, block)
                    + h2c.raw_frame(frames.DATA, frames.END_STREAM, sid, h2c.grpc_message(b""))
                )
                await ping_answered(stream, h2c)
            # Two caches (blocks, call plans) of 256 KiB each, and the connection's buffers.
            assert traced_now() - before < 2 * MiB
        await trio.testing.wait_all_tasks_blocked()
        assert traced_now() - before < 256 * 1024
