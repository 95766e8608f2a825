"""Fair accepting (``_admission.py``): a client that asks something is started before a
crowd of quiet ones, a bounded number of connections start per turn of the event loop,
and past ``max_pending`` the quiet one that waited longest makes room; a crowd leaving
at once is torn down a bounded number a turn.

The policy (``StartOrder``) is tested alone with exact expectations; the acceptor with
real sockets on 127.0.0.1, under trio's mock clock (autojump: nothing here waits on
time), recording which connections each turn started; the cores with real servers, a
crowd of idle connections and a probe from real clients.
"""

from __future__ import annotations

import os
import socket
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from typing import Any

import grpc
import pytest
import trio
import trio.testing

from trioserve import Server, ServerConfig, _admission
from trioserve._admission import (
    _ACCEPTS_PER_TURN,
    _STARTS_PER_TURN,
    Departures,
    StartOrder,
    accept_forever,
)
from trioserve.testing import server_in_thread

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def test_those_that_asked_start_first_in_turn_then_the_quiet_newest_first() -> None:
    order = StartOrder()
    for key in range(6):
        order.arrived(key)
    order.asked(4)
    order.asked(1)
    order.asked(4)  # asked again: keeps its place
    order.asked(9)  # not pending: ignored
    assert list(order.take(3)) == [4, 1, 5]
    order.discard(3)
    assert len(order) == 2
    assert order.oldest_quiet() == 0
    assert list(order.take(5)) == [2]
    assert order.oldest_quiet() is None and len(order) == 0
    for key in range(4):
        order.arrived(key)
    order.asked(2)
    assert list(order.take(3, quiet_too=False)) == [2]  # the quiet ones stay
    assert list(order.take(3)) == [3, 1, 0]


class Turns:
    """Counts the acceptor's turns (the checkpoints it yields at), and which clients (by
    their port) each started connection came from, with its turn."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.turn = 0
        self.started: list[tuple[int, int, bytes]] = []  # (turn, client port, received)
        monkeypatch.setattr(_admission, "checkpoint", self.checkpoint)

    async def checkpoint(self) -> None:
        self.turn += 1
        await trio.lowlevel.checkpoint()

    def accepted(
        self, sock: socket.socket, client: tuple[str, int], local: object, received: bytes
    ) -> None:
        self.started.append((self.turn, client[1], received))
        sock.close()

    def batches(self) -> list[list[int]]:
        """The client ports started, turn by turn."""
        by_turn: dict[int, list[int]] = {}
        for turn, port, _ in self.started:
            by_turn.setdefault(turn, []).append(port)
        return list(by_turn.values())


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(4096)
        sock.setblocking(False)
        yield sock


@pytest.fixture
def clients() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def connect(listener: socket.socket, clients: ExitStack, count: int) -> list[socket.socket]:
    """``count`` clients of ``listener``, each in its accept queue once this returns."""
    address = listener.getsockname()
    crowd = [clients.enter_context(socket.create_connection(address)) for _ in range(count)]
    wait_queued(listener, count)
    return crowd


def wait_queued(listener: socket.socket, count: int) -> None:
    """Until the kernel has moved ``count`` handshakes into ``listener``'s accept queue.

    A client's connect returns on the server's SYN-ACK; its ACK, which puts the connection
    in the queue, may still wait for the kernel's turn on a loaded machine, and the
    acceptor would then see fewer clients in its first turn than the test placed. Linux
    reports a listener's queue length as TCP_INFO's ``tcpi_unacked`` (the sixth u32, after
    eight u8 fields); elsewhere connect returning is taken as enough.
    """
    if not hasattr(socket, "TCP_INFO"):
        return
    deadline = time.monotonic() + 10
    while True:
        info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
        (queued,) = struct.unpack_from("I", info, 24)
        if queued >= count:
            return
        assert time.monotonic() < deadline, f"{queued} of {count} clients queued after 10 s"
        os.sched_yield()  # lets the kernel's deferred work (the ACKs) run


def port(sock: socket.socket) -> int:
    port_number: int = sock.getsockname()[1]
    return port_number


async def run_until(turns: Turns, listener: socket.socket, started: int, **options: Any) -> None:
    """Accept on ``listener`` until ``started`` connections started."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(accept_forever, listener, turns.accepted, **options))
        while len(turns.started) < started:
            await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()


async def test_a_client_that_asked_starts_ahead_of_the_crowd(
    autojump_clock: trio.testing.MockClock,
    listener: socket.socket,
    clients: ExitStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """41 clients wait in the listen queue, the first of which sent a byte (without a
    greeting, any byte asks): the first turn starts the 16 newest (the byte is not
    seen yet: sockets are watched once taken), the next the one that asked, then the
    next newest, and so on: 16 a turn, never more."""
    crowd = connect(listener, clients, 41)
    crowd[0].send(b"G")
    turns = Turns(monkeypatch)
    await run_until(turns, listener, 41)
    ports = [port(sock) for sock in crowd]
    assert _STARTS_PER_TURN == 16
    assert _ACCEPTS_PER_TURN > 41  # all taken the first turn
    assert (
        turns.batches()
        == [
            ports[:24:-1],  # the 16 newest
            [ports[0], *ports[24:9:-1]],  # the one that asked, then the next 15 newest
            ports[9:0:-1],  # the rest, newest first
        ]
    )
    assert [received for _, _, received in turns.started] == [b""] * 41  # nothing read


async def test_while_more_wait_to_be_accepted_only_clients_that_asked_start(
    autojump_clock: trio.testing.MockClock,
    listener: socket.socket,
    clients: ExitStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20 clients wait, 8 are accepted a turn, and the 1st and 11th sent a byte: while
    a turn took all it may (more wait in the listen queue), only a client that asked
    starts (each is seen asking the turn after it was taken); once the queue is empty,
    the quiet ones start too, 16 a turn."""
    monkeypatch.setattr(_admission, "_ACCEPTS_PER_TURN", 8)
    crowd = connect(listener, clients, 20)
    crowd[0].send(b"G")
    crowd[10].send(b"G")
    turns = Turns(monkeypatch)
    await run_until(turns, listener, 20)
    ports = [port(sock) for sock in crowd]
    assert (
        [(turn, p) for turn, p, _ in turns.started]
        == [
            (1, ports[0]),  # clients 8-15 taken: more may wait
            *[(2, p) for p in [ports[10], *ports[19:10:-1], *ports[9:3:-1]]],  # 16-19 taken
            *[(3, p) for p in ports[3:0:-1]],
        ]
    )


class Greeter:
    """A greeting that says "hi", and counts a client as asking once it sent "?"."""

    def greet(self, sock: socket.socket) -> None:
        sock.send(b"hi")

    def asks(self, received: bytes) -> bool:
        return b"?" in received


async def test_with_a_greeting_only_a_question_puts_a_client_ahead(
    autojump_clock: trio.testing.MockClock,
    listener: socket.socket,
    clients: ExitStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each client is greeted and what it sent is read (then handed to its connection):
    bytes that ask nothing leave it quiet; a client that leaves is closed unstarted."""
    crowd = connect(listener, clients, 20)
    ports = [port(sock) for sock in crowd[:1] + crowd[2:]]
    for sock in crowd:
        sock.send(b"hello")
    crowd[0].send(b"?")  # asks, before it is taken
    crowd[1].close()  # leaves before it is taken
    turns = Turns(monkeypatch)
    await run_until(turns, listener, 19, greeting=Greeter())
    assert turns.batches() == [[ports[0], *ports[:3:-1]], ports[3:0:-1]]
    assert {received for _, _, received in turns.started} == {b"hello", b"hello?"}
    assert [received for _, p, received in turns.started if p == ports[0]] == [b"hello?"]
    for sock in crowd[2:]:
        assert sock.recv(2) == b"hi"


async def test_past_max_pending_the_quiet_one_that_waited_longest_makes_room(
    autojump_clock: trio.testing.MockClock,
    listener: socket.socket,
    clients: ExitStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    crowd = connect(listener, clients, 6)
    evictions: list[None] = []
    turns = Turns(monkeypatch)
    await run_until(turns, listener, 4, max_pending=4, evicted=lambda: evictions.append(None))
    ports = [port(sock) for sock in crowd]
    assert turns.batches() == [ports[:1:-1]]
    assert len(evictions) == 2
    for sock in crowd[:2]:  # closed unstarted: the client reads the end
        assert sock.recv(1) == b""


# --- the cores, from real clients ----------------------------------------------------


def crowd_then_probe(
    count: int, address: tuple[str, int], first_words: bytes, probe: Callable[[], None]
) -> float:
    """Open ``count`` idle connections back to back (each says ``first_words``), then
    time ``probe()`` on a fresh connection while the server still works through them."""
    with ExitStack() as held:
        for _ in range(count):
            sock = held.enter_context(socket.create_connection(address))
            sock.sendall(first_words)
        began = time.perf_counter()
        probe()
        return time.perf_counter() - began


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    config = ServerConfig(http_port=0, grpc_port=0)
    with server_in_thread(config) as running:
        yield running


def test_a_grpc_probe_is_answered_while_a_crowd_arrives(server: Server) -> None:
    port_number = server.grpc_port

    def live() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port_number}") as channel:
            call = channel.unary_unary(
                "/inference.GRPCInferenceService/ServerLive",
                request_serializer=lambda _: b"",
                response_deserializer=lambda data: data,
            )
            call(None, timeout=10)

    assert crowd_then_probe(500, ("127.0.0.1", port_number), PREFACE, live) < 1.0


def test_an_http_probe_is_answered_while_a_crowd_arrives(server: Server) -> None:
    port_number = server.http_port

    def live() -> None:
        url = f"http://127.0.0.1:{port_number}/v2/health/live"
        assert urllib.request.urlopen(url, timeout=10).status == 200

    assert crowd_then_probe(500, ("127.0.0.1", port_number), b"", live) < 1.0


async def test_a_leaving_crowd_tears_down_a_bounded_number_a_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``Departures.leave_in_turn``: 64 connections may go in a turn without waiting;
    the next waits for a turn to pass, and every one of a crowd gets its turn."""
    departures = Departures()
    with trio.testing.assert_no_checkpoints():
        for _ in range(Departures.PER_TURN):
            await departures.leave_in_turn()
    with trio.testing.assert_checkpoints():
        await departures.leave_in_turn()
    left: list[None] = []

    async def leave() -> None:
        await departures.leave_in_turn()
        left.append(None)

    async with trio.open_nursery() as nursery:
        for _ in range(1000):
            nursery.start_soon(leave)
    assert len(left) == 1000


async def test_without_epoll_every_client_still_starts_newest_first(
    autojump_clock: trio.testing.MockClock,
    listener: socket.socket,
    clients: ExitStack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where there is no epoll (not Linux), the acceptor waits on its listener alone."""
    monkeypatch.delattr(_admission.select, "epoll")
    crowd = connect(listener, clients, 5)
    crowd[0].send(b"G")  # cannot be seen to ask: it starts with the quiet ones
    turns = Turns(monkeypatch)
    await run_until(turns, listener, 5)
    assert turns.batches() == [[port(sock) for sock in reversed(crowd)]]
