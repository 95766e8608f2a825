"""The disconnect sweeper under MockClock: who gets watched, and when."""

import socket
import struct
from typing import Any

import pytest
import trio

from trioserve.rest._app import Request
from trioserve.rest._disconnects import DisconnectWatch


def _request(receive: Any, hint: dict[str, Any] | None = None) -> Request:
    async def send(message: Any) -> None:
        raise AssertionError("the watch never sends")

    return Request("POST", "/", {}, {}, b"", receive, send, hint)


class FakeTicket:
    def __init__(self) -> None:
        self.withdrawn_at: float | None = None

    def withdraw(self) -> None:
        self.withdrawn_at = trio.current_time()


async def test_only_requests_outliving_the_grace_period_are_watched(autojump_clock):
    watch = DisconnectWatch(grace_s=0.005)
    client_gone = trio.Event()
    watched_at: list[float] = []

    async def receive():
        watched_at.append(trio.current_time())
        await client_gone.wait()
        return {"type": "http.disconnect"}

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        fast, slow, answered = FakeTicket(), FakeTicket(), FakeTicket()
        entry = watch.track(fast, _request(receive))  # t = 0
        await trio.sleep(0.004)
        watch.untrack(fast, entry)  # answered after 4 ms: never watched
        watch.track(slow, _request(receive))  # t = 4 ms; the sweep at 5 ms finds it too young
        await trio.sleep(0.0015)
        late_entry = watch.track(answered, _request(receive))  # t = 5.5 ms
        await trio.sleep(0.0055)
        # The sweep at 10 ms watched the one that had waited 6 ms, not the 4.5 ms-old one.
        assert watched_at == pytest.approx([0.010])
        await trio.sleep(0.005)  # the sweep at 15 ms watches the second
        assert watched_at == pytest.approx([0.010, 0.015])
        watch.untrack(answered, late_entry)  # answered while watched: its watcher stops
        client_gone.set()
        await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    assert fast.withdrawn_at is None
    assert answered.withdrawn_at is None
    assert slow.withdrawn_at == pytest.approx(0.016)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A server-side socket and its client, over loopback TCP (so a reset is a real RST)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return server, client


async def _receive_from(sock: socket.socket, calls: list[float]) -> dict[str, str]:
    """What our HTTP/1.1 core's receive() does after the body: wait for EOF."""
    calls.append(trio.current_time())
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            if not sock.recv(4096):
                return {"type": "http.disconnect"}
        except ConnectionError:
            return {"type": "http.disconnect"}


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
async def test_a_named_socket_is_polled_and_watched_only_once_it_hangs_up(autojump_clock, reset):
    watch = DisconnectWatch(grace_s=0.005)
    ours, theirs = _tcp_pair()
    calls: list[float] = []
    with ours, theirs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            ticket = FakeTicket()
            hint = {"fd": ours.fileno()}
            watch.track(ticket, _request(lambda: _receive_from(ours, calls), hint))
            await trio.sleep(0.012)  # polled since the sweep at 10 ms: no watcher task
            theirs.send(b"GET /next HTTP/1.1\r\n\r\n")  # pipelined input is no hangup
            await trio.sleep(0.01)
            assert calls == [] and ticket.withdrawn_at is None
            if reset:
                theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            theirs.close()
            await trio.sleep(0.001)
            assert calls == pytest.approx([0.022])  # the hangup started a watcher at once
            assert ticket.withdrawn_at == pytest.approx(0.022)
            nursery.cancel_scope.cancel()


async def test_a_connection_joins_the_hangup_set_once_for_all_its_requests(autojump_clock):
    watch = DisconnectWatch(grace_s=0.005)
    ours, theirs = _tcp_pair()
    calls: list[float] = []
    with ours, theirs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.run)
            hint = {"fd": ours.fileno()}
            first, second = FakeTicket(), FakeTicket()
            entry = watch.track(first, _request(lambda: _receive_from(ours, calls), hint))
            await trio.sleep(0.012)
            assert entry.polled
            watch.untrack(first, entry)  # answered at 12 ms
            watch.track(second, _request(lambda: _receive_from(ours, calls), hint))
            theirs.close()  # at 12 ms, while the second request is still in its grace period
            await trio.sleep(0.004)
            assert calls == []  # the socket is remembered as hung up; nobody watches yet
            await trio.sleep(0.002)
            # The sweep at 17 ms (the grace period after the arrival at 12 ms) watches the
            # second request at once: its socket's hangup edge has passed already.
            assert calls == pytest.approx([0.017])
            assert second.withdrawn_at == pytest.approx(0.017)
            assert first.withdrawn_at is None and not entry.polled
            nursery.cancel_scope.cancel()
