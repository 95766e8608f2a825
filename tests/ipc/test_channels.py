"""Frames and channels: split anywhere, descriptors in order, batches, a real child."""

from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.ipc import (
    Arena,
    BlockingChannel,
    FrameError,
    FrameReader,
    LinkClosed,
    Pending,
    PendingCalls,
    Replies,
    TrioChannel,
    _frames,
    channel_pair,
    encode_frames,
)

MESSAGES = st.lists(
    st.recursive(
        st.none() | st.integers() | st.text(max_size=20) | st.binary(max_size=40),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=8,
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=80, deadline=None)
@given(MESSAGES, st.data())
def test_frames_split_anywhere_read_the_same(messages: list[object], data: st.DataObject) -> None:
    encoded, _ = encode_frames([(m, ()) for m in messages])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(encoded)), max_size=6)))
    reader = FrameReader()
    got: list[object] = []
    for start, end in zip([0, *cuts], [*cuts, len(encoded)], strict=True):
        got.extend(message for message, _ in reader.feed(encoded[start:end]))
    assert got == messages


def test_each_frame_gets_the_descriptors_its_header_names() -> None:
    encoded, fds = encode_frames([("a", [10, 11]), ("b", []), ("c", [12])])
    assert fds == [10, 11, 12]
    frames = FrameReader().feed(encoded, fds)
    assert frames == [("a", [10, 11]), ("b", []), ("c", [12])]


def test_messages_past_the_frame_bound_go_in_several_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Messages sent together are one frame, unless that frame would exceed the bound:
    then halves, each a frame, read back in order with their descriptors."""
    monkeypatch.setattr(_frames, "MAX_FRAME_BYTES", 300)
    messages = [(f"m{i}", [20 + i] if i % 2 else []) for i in range(6)]
    big = [("x" * 100 + str(i), fds) for i, (_, fds) in enumerate(messages)]
    together, _ = encode_frames(messages)
    apart, fds = encode_frames(big)
    assert len(together) < 300 and fds == [21, 23, 25]
    headers = []
    offset = 0
    while offset < len(apart):
        length, count = _frames.HEADER.unpack_from(apart, offset)
        assert length <= 300
        headers.append(count)
        offset += _frames.HEADER.size + length
    assert len(headers) > 1 and sum(headers) == 3
    assert FrameReader().feed(apart, fds) == [(m, list(f)) for m, f in big]


def test_garbage_is_a_frame_error() -> None:
    with pytest.raises(FrameError, match="exceeds"):
        FrameReader().feed(b"\xff\xff\xff\xff\x00\x00\x00\x00")
    with pytest.raises(FrameError, match="does not decode"):
        FrameReader().feed(b"\x03\x00\x00\x00\x00\x00\x00\x00abc")
    with pytest.raises(FrameError, match="descriptors"):
        FrameReader().feed(encode_frames([("x", [5])])[0])


# A child that doubles each float32 block it is sent, writing the answer into its own arena.
_DOUBLER = textwrap.dedent(
    """
    import os, socket, sys, numpy as np
    from trioserve.ipc import Arena, BlockingChannel, SegmentMap
    channel = BlockingChannel(socket.socket(fileno=int(sys.argv[1])))
    theirs, mine = SegmentMap(), Arena(1 << 16, 1 << 16)
    while True:
        (call, segments, block), fds = channel.receive()
        for (segment, size), fd in zip(segments, fds):
            theirs.add(segment, fd, size)
        if call == "exit":
            os._exit(3)
        values = np.frombuffer(theirs.view(block), np.float32)
        answer = mine.write((values * 2).tobytes())
        fresh = mine.unannounced([answer])
        channel.send((call, [(s, n) for s, _, n in fresh], answer), [fd for _, fd, _ in fresh])
    """
)


async def _start_doubler() -> tuple[trio.Process, TrioChannel]:
    parent, child = channel_pair()
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", _DOUBLER, str(child.fileno())], pass_fds=[child.fileno()]
    )
    child.close()
    return process, TrioChannel(parent)


async def test_tensors_cross_through_shared_memory_with_frames_batched() -> None:
    process, channel = await _start_doubler()
    arena = Arena(1 << 16, 1 << 16)
    from trioserve.ipc import SegmentMap

    answers = SegmentMap()
    try:

        async def send(call: int) -> None:
            block = arena.write(np.full(1000, call, np.float32).tobytes())
            # Announced in the same step as the frame is queued: frames go in queue order.
            fresh = arena.unannounced([block])
            message = (call, [(s, n) for s, _, n in fresh], block)
            await channel.send(message, [fd for _, fd, _ in fresh])

        async with trio.open_nursery() as nursery:
            for call in range(50):  # all at once: one write carries many frames
                nursery.start_soon(send, call)
        assert channel.frames_sent == 50 and channel.writes < 50
        got: dict[int, np.ndarray] = {}
        while len(got) < 50:
            for (call, segments, block), fds in await channel.receive():
                for (segment, size), fd in zip(segments, fds, strict=True):
                    answers.add(segment, fd, size)
                got[call] = np.frombuffer(answers.view(block), np.float32).copy()
        for call in range(50):
            assert np.array_equal(got[call], np.full(1000, call * 2, np.float32))
        await channel.send(("exit", [], None))
        assert await process.wait() == 3
        with pytest.raises(LinkClosed):
            await channel.receive()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        channel.close()
        answers.close()
        arena.close()


async def test_a_killed_child_closes_the_link() -> None:
    process, channel = await _start_doubler()
    try:
        os.kill(process.pid, signal.SIGKILL)
        assert await process.wait() == -signal.SIGKILL
        with pytest.raises(LinkClosed):
            await channel.receive()
        with pytest.raises(LinkClosed):
            for _ in range(100):  # the first send may still reach the kernel's buffer
                await channel.send(("x", [], None))
    finally:
        channel.close()


async def test_a_peer_that_exits_with_frames_unread_closes_the_link() -> None:
    """A peer that dies with frames of ours still unread (a worker killed under load)
    resets the socket: the next receive raises ECONNRESET, which ends the link like any
    other close, not the receiver with it. So on both ends: trio's and a thread's."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = TrioChannel(ours)
    try:
        await channel.send(("never read",))
        theirs.close()  # with the frame in its receive buffer
        with pytest.raises(LinkClosed):
            await channel.receive()
    finally:
        channel.close()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    blocking = BlockingChannel(ours)
    try:
        blocking.send(("never read",))
        theirs.close()
        with pytest.raises(LinkClosed):
            blocking.receive()
    finally:
        blocking.close()


async def test_replies_reach_their_callers_and_a_dead_link_fails_the_rest() -> None:
    replies: Replies[str] = Replies()
    first, first_answers = replies.open()
    second, second_answers = replies.open()
    streamed, streamed_answers = replies.open()
    assert replies.deliver(first, "one")
    assert replies.deliver(streamed, "a", last=False)
    assert replies.deliver(streamed, "b", last=False)
    replies.withdraw(second)
    assert not replies.deliver(second, "late")
    assert not replies.deliver(first, "again")
    replies.fail_all(LinkClosed("gone"))
    assert [a async for a in first_answers] == ["one"]
    assert [a async for a in second_answers] == []
    rest = [a async for a in streamed_answers]
    assert rest[:2] == ["a", "b"] and isinstance(rest[2], LinkClosed)
    assert len(replies) == 0


async def test_pending_calls_get_one_answer_each_and_a_dead_link_fails_the_rest() -> None:
    calls: PendingCalls[str] = PendingCalls()
    answered, waiting, withdrawn, cancelled = (calls.open() for _ in range(4))
    assert calls.deliver(answered.call, "one")
    assert not calls.deliver(answered.call, "again")  # one answer per call
    assert await answered.wait() == "one"  # it came before the wait: no parking

    got: list[object] = []

    async def wait_for(pending: Pending[str | BaseException]) -> None:
        got.append(await pending.wait())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for, waiting)
        with trio.CancelScope() as scope:
            scope.cancel()
            await cancelled.wait()  # parks, and is cancelled: it takes no answer
        calls.withdraw(cancelled.call)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # parked until its answer comes
        assert calls.deliver(waiting.call, "two")
    assert got == ["two"]
    calls.withdraw(withdrawn.call)
    assert not calls.deliver(withdrawn.call, "late")
    assert not calls.deliver(cancelled.call, "late")
    late = calls.open()
    calls.fail_all(LinkClosed("gone"))
    assert isinstance(await late.wait(), LinkClosed)


@pytest.mark.parametrize("coalesce", [False, True])
async def test_coalescing_sends_the_frames_of_one_turn_in_one_write(coalesce: bool) -> None:
    """Without it, each send writes its frame at once (the socket has room: no send
    waits); with it, every frame sent in the same turn of the event loop goes out in one
    write."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = TrioChannel(ours, coalesce=coalesce)
    peer = TrioChannel(theirs)
    try:
        async with trio.open_nursery() as nursery:
            for call in range(10):
                nursery.start_soon(channel.send, ("call", call))
        assert channel.frames_sent == 10
        assert channel.writes == (1 if coalesce else 10)
        received: list[object] = []
        while len(received) < 10:
            received += [message for message, _ in await peer.receive()]
        assert sorted(received) == [("call", n) for n in range(10)]  # trio orders tasks freely
    finally:
        channel.close()
        peer.close()


async def test_a_coalescing_send_under_a_cancelled_scope_still_writes_its_frame() -> None:
    """The schedule point a coalescing send takes before writing is no cancel point: a
    caller whose scope is already cancelled still gets its frame written, whole, and the
    frames after it arrive intact."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = TrioChannel(ours, coalesce=True)
    peer = TrioChannel(theirs)
    try:
        with trio.CancelScope() as scope:
            scope.cancel()
            await channel.send(("first",))
            sent_while_cancelled = channel.writes
        await channel.send(("second",))
        assert sent_while_cancelled == 1
        received: list[object] = []
        while len(received) < 2:
            received += [message for message, _ in await peer.receive()]
        assert received == [("first",), ("second",)]
    finally:
        channel.close()
        peer.close()


async def test_frames_larger_than_a_read_and_than_the_socket_buffer_arrive_whole() -> None:
    """A frame bigger than the socket's buffer (the sender waits for room, then writes
    the rest; the receiver puts it together from several reads), with descriptors riding
    on the first bytes and a small frame after it: all arrive whole, in order."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = TrioChannel(ours)
    peer = TrioChannel(theirs)
    big = bytes(range(256)) * (4 * _frames.READ_BYTES // 256)
    passed_read, passed_write = os.pipe()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.send, ("big", big), [passed_read])
            received: list[tuple[object, list[int]]] = []
            while not received:  # the sender is blocked until the peer reads
                received += await peer.receive()
            await channel.send(("small",))
            while len(received) < 2:
                received += await peer.receive()
        (first, fds), (second, none) = received
        assert first == ("big", big) and second == ("small",) and none == []
        assert len(fds) == 1
        os.write(passed_write, b"x")  # the descriptor that came is the pipe's read end
        assert os.read(fds[0], 1) == b"x"
        os.close(fds[0])
    finally:
        channel.close()
        peer.close()
        os.close(passed_read)
        os.close(passed_write)


async def test_a_full_read_reads_on_then_waits_when_nothing_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read that fills its buffer may have left bytes in the socket: the next read
    comes without a wait; when it finds nothing (the frame's rest is not sent yet), the
    receiver waits for it."""
    monkeypatch.setattr("trioserve.ipc._channels.READ_BYTES", 64)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = TrioChannel(ours)
    data, _ = encode_frames([(("call", bytes(200)), [])])
    received: list[tuple[object, list[int]]] = []

    async def receive() -> None:
        received.extend(await channel.receive())

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            theirs.send(data[:128])  # two full reads, then none: the receiver waits
            await trio.testing.wait_all_tasks_blocked()
            assert received == []
            theirs.send(data[128:])
        assert received == [(("call", bytes(200)), [])]
    finally:
        channel.close()
        theirs.close()


async def test_write_now_writes_at_once_or_leaves_the_rest_for_flush_in_order() -> None:
    """``write_now`` (for code that cannot wait) writes frames whole when the socket takes
    them; when it takes only a part, the rest waits for ``flush`` and goes out before
    any frame sent after it, and frames given while that write is under way go with it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = TrioChannel(ours)
    peer = TrioChannel(theirs)
    big = bytes(range(256)) * (4 * _frames.READ_BYTES // 256)  # more than the buffer
    received: list[object] = []

    async def receive(count: int) -> None:
        while len(received) < count:
            received.extend(message for message, _ in await peer.receive())

    try:
        assert channel.write_now([("one",), ("two",)])
        assert channel.writes == 1 and channel.frames_sent == 2
        await receive(2)
        assert not channel.write_now([("big", big)])  # the socket took a part of it
        assert not channel.write_now([("after",)])  # queued behind the rest: flush
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.flush)  # waits for room as the peer reads
            await trio.testing.wait_all_tasks_blocked()
            assert channel.write_now([("during",)])  # the write under way sends it
            await channel.send(("sent",))  # so does a send: no write of its own
            nursery.start_soon(receive, 6)
        assert received == [("one",), ("two",), ("big", big), ("after",), ("during",), ("sent",)]
        channel.close()
        with pytest.raises(LinkClosed):
            channel.write_now([("closed",)])
    finally:
        channel.close()
        peer.close()
