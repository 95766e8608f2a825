"""Who learns that an HTTP client left, and when, under MockClock: the HTTP/1.1 core's
hangup watch (``trioserve.cancel_with``) and the ``receive()`` fallback for other servers."""

import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from trioserve.rest._disconnects import ReceiveWatch
from trioserve.rest._grace import GracePeriod
from trioserve.rest._http11_hangups import Hangups


class FakeTicket:
    def __init__(self) -> None:
        self.withdrawn_at: float | None = None

    def withdraw(self) -> None:
        self.withdrawn_at = trio.current_time()


# --- the grace period ----------------------------------------------------------------------


async def test_the_grace_period_hands_over_after_one_to_two_periods(autojump_clock):
    handed: list[tuple[str, float]] = []
    grace = GracePeriod(0.005, lambda item: handed.append((item, trio.current_time())))
    async with trio.open_nursery() as nursery:
        grace.arrived("a")  # t = 0: wakes the sweeper, its period starts with it
        nursery.start_soon(grace.run)
        await trio.sleep(0.001)
        grace.arrived("b")  # waited 4 ms at the tick at 5 ms: handed over at 10
        await trio.sleep(0.002)
        grace.arrived("answered")  # t = 3 ms, answered at 7 ms: never handed over
        await trio.sleep(0.0025)
        grace.arrived("c")  # t = 5.5 ms: after the tick at 5, so at 15
        await trio.sleep(0.0015)
        grace.forget("answered")
        assert "c" in grace and "answered" not in grace
        await trio.sleep(0.013)  # t = 20 ms: nothing waits, the sweeper sleeps
        grace.arrived("d")
        await trio.sleep(0.006)
        nursery.cancel_scope.cancel()
    assert [item for item, _ in handed] == ["a", "b", "c", "d"]
    assert [at for _, at in handed] == pytest.approx([0.005, 0.010, 0.015, 0.025])


# --- the fallback: receive() -------------------------------------------------------------


async def test_only_requests_outliving_the_grace_period_are_watched(autojump_clock):
    watch = ReceiveWatch(grace_s=0.005)
    client_gone = trio.Event()
    watched_at: list[float] = []

    async def receive():
        watched_at.append(trio.current_time())
        await client_gone.wait()
        return {"type": "http.disconnect"}

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        fast, slow, answered = FakeTicket(), FakeTicket(), FakeTicket()
        fast_hook = watch.cancel_with(receive)
        fast_hook(fast.withdraw)  # t = 0
        await trio.sleep(0.004)
        fast_hook(None)  # answered after 4 ms: never watched
        watch.cancel_with(receive)(slow.withdraw)  # t = 4 ms; the sweep at 5 ms: too young
        await trio.sleep(0.0015)
        late_hook = watch.cancel_with(receive)
        late_hook(answered.withdraw)  # t = 5.5 ms
        await trio.sleep(0.0055)
        # The sweep at 10 ms watched the one that had waited 6 ms, not the 4.5 ms-old one.
        assert watched_at == pytest.approx([0.010])
        await trio.sleep(0.005)  # the sweep at 15 ms watches the second
        assert watched_at == pytest.approx([0.010, 0.015])
        late_hook(None)  # answered while watched: its watcher stops
        client_gone.set()
        await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    assert fast.withdrawn_at is None
    assert answered.withdrawn_at is None
    assert slow.withdrawn_at == pytest.approx(0.016)


# --- the HTTP/1.1 core: its hangup epoll ---------------------------------------------------


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A server-side socket and its client, over loopback TCP (so a reset is a real RST)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return server, client


@dataclass
class Peer:
    """What the watch sees of a connection."""

    fd: int
    peer_closed: bool = False


@dataclass
class Watched:
    hangups: Hangups
    hook: Any  # the connection's CancelHook
    peer: Peer
    ours: socket.socket  # the server's side
    theirs: socket.socket  # the client's


@asynccontextmanager
async def watched_connection() -> AsyncIterator[Watched]:
    """A connection over loopback TCP, its hook in a running hangup watch."""
    hangups = Hangups(grace_s=0.005)
    ours, theirs = _tcp_pair()
    with ours, theirs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hangups.run)
            peer = Peer(ours.fileno())
            yield Watched(hangups, hangups.hook(peer), peer, ours, theirs)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
async def test_a_waiting_requests_socket_is_polled_and_withdrawn_when_it_hangs_up(
    autojump_clock, reset
):
    async with watched_connection() as w:
        ticket = FakeTicket()
        w.hook.cancel_with(ticket.withdraw)
        await trio.sleep(0.012)  # polled since the sweep at 10 ms: no task, no read
        assert w.hook.joined
        w.theirs.send(b"GET /next HTTP/1.1\r\n\r\n")  # pipelined input is no hangup
        await trio.sleep(0.01)
        assert ticket.withdrawn_at is None and not w.peer.peer_closed
        if reset:
            w.theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.theirs.close()
        await trio.sleep(0.001)
        assert ticket.withdrawn_at == pytest.approx(0.022)  # at the hangup
        assert w.peer.peer_closed  # the connection carries no further request
        assert w.ours.recv(4096) == b"GET /next HTTP/1.1\r\n\r\n"  # nothing was read


async def test_a_request_answered_within_the_grace_period_costs_no_registration(
    autojump_clock,
):
    async with watched_connection() as w:
        ticket = FakeTicket()
        w.hook.cancel_with(ticket.withdraw)
        await trio.sleep(0.004)
        w.hook.cancel_with(None)  # answered after 4 ms
        await trio.sleep(0.02)
        assert not w.hook.joined
        w.theirs.close()
        await trio.sleep(0.001)
        assert ticket.withdrawn_at is None


async def test_a_connection_joins_the_hangup_set_once_for_all_its_requests(autojump_clock):
    async with watched_connection() as w:
        first, second = FakeTicket(), FakeTicket()
        w.hook.cancel_with(first.withdraw)
        await trio.sleep(0.012)
        assert w.hook.joined
        w.hook.cancel_with(None)  # answered at 12 ms
        w.hook.cancel_with(second.withdraw)
        w.theirs.close()  # at 12 ms, while the second request is still in its grace period
        await trio.sleep(0.004)
        assert second.withdrawn_at is None  # remembered as hung up; not withdrawn yet
        await trio.sleep(0.002)
        # The sweep at 17 ms (the grace period after the arrival at 12 ms) withdraws the
        # second request at once: its socket's hangup edge has passed already.
        assert second.withdrawn_at == pytest.approx(0.017)
        assert first.withdrawn_at is None


async def test_a_closed_connection_leaves_the_watch(autojump_clock):
    async with watched_connection() as w:
        ticket = FakeTicket()
        w.hook.cancel_with(ticket.withdraw)
        await trio.sleep(0.012)
        w.hangups.closed(w.hook)  # the connection task ends, and closes its socket
        w.ours.close()
        w.theirs.close()
        await trio.sleep(0.01)
        assert ticket.withdrawn_at is None and w.hook.withdraw is None
