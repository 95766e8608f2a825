"""Accepting connections fairly: a client that arrives with a crowd is served at once.

Starting a connection costs its core a task and some 100 µs of set-up. A burst of
thousands of connections arrives faster than that, and the kernel's listen queue is
first come, first served: a client behind thousands waited for all of them, and a full
queue drops new clients' SYNs (a second before the client tries again). So, for each
listener, ``accept_forever``:

* asks for a listen queue as deep as the kernel allows (``_sockets.bind_tcp``) and
  empties it ``_ACCEPTS_PER_TURN`` a turn (an accept and its greeting cost some 15 µs,
  so a turn stays about a ms long: a started connection needs a few turns to answer its
  client, each one of them as long as the acceptor's), into a queue of its own of at
  most ``max_pending`` sockets;
* greets each socket as it takes it, where the core has a ``Greeting`` (HTTP/2 sends its
  SETTINGS at once, which a gRPC client waits for before it sends a call), reads what
  the client has sent, and watches the socket in an epoll set of its own
  (edge-triggered, so a socket wakes the acceptor only when more arrives);
* starts at most ``_STARTS_PER_TURN`` connections a turn, then lets every other task
  run: first those whose client asked something (a request, a call; any byte at all
  without a greeting), in the order they asked, then the quiet ones, newest first; but
  no quiet one while the listen queue holds more clients (a turn took all it may), so
  that the turns between accepts stay short and the queue empties at full speed.

A client with something to ask is started within a turn or two, however many idle
connections arrived with it; the idle ones start as the turns allow (the greeted ones
wait for nothing meanwhile). A client that leaves before its connection starts is
closed then and there. When a crowd leaves at once, the cores tear its connections down
a bounded number a turn (``Departures``), for the same reason.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
from collections.abc import Callable, Iterator
from typing import Protocol

import trio
from trio.lowlevel import checkpoint, wait_readable

logger = logging.getLogger("trioserve")

Address = tuple[str, int]
Accepted = Callable[[socket.socket, Address, Address, bytes], None]
"""Starts a connection: its socket, the client's and the local address, and what was
read of the client before it started (only with a ``Greeting``; else b"")."""

# Out of descriptors or memory: accepting again at once would spin, so wait a little.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_BACKOFF_S = 0.1
_ACCEPTS_PER_TURN = 64  # clients taken from the listen queue in one turn (about a ms)
_STARTS_PER_TURN = 16  # connections started in one turn
_READ_MOST = 64 * 1024  # of a pending client's bytes: past this, it has surely asked
# A pending socket wakes the acceptor when more arrives or its client hangs up, once.
_WATCHED = (
    getattr(select, "EPOLLIN", 0) | getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLET", 0)
)


class Greeting(Protocol):
    """A core's first words to a client, before its connection starts."""

    def greet(self, sock: socket.socket) -> None:
        """Say them (without blocking); ``OSError`` if the client is gone."""

    def asks(self, received: bytes) -> bool:
        """Whether the client, having sent ``received`` so far, asks something."""


class StartOrder:
    """Which pending connections start first: those whose client asked something, in
    the order they asked, then the quiet ones, newest first."""

    __slots__ = ("_asking", "_quiet")

    def __init__(self) -> None:
        self._quiet: dict[int, None] = {}  # in arrival order
        self._asking: dict[int, None] = {}  # in the order they asked

    def __len__(self) -> int:
        return len(self._quiet) + len(self._asking)

    @property
    def quiet(self) -> int:
        return len(self._quiet)

    def arrived(self, key: int) -> None:
        self._quiet[key] = None

    def asked(self, key: int) -> None:
        if key in self._quiet:  # (one that asked before keeps its place)
            del self._quiet[key]
            self._asking[key] = None

    def discard(self, key: int) -> None:
        self._quiet.pop(key, None)
        self._asking.pop(key, None)

    def oldest_quiet(self) -> int | None:
        """The quiet one that waited longest, taken out of the order (None: none is)."""
        for key in self._quiet:
            del self._quiet[key]
            return key
        return None

    def take(self, most: int, quiet_too: bool = True) -> Iterator[int]:
        """Up to ``most`` connections to start now, each taken out of the order; only
        those that asked unless ``quiet_too``."""
        for _ in range(min(most, len(self) if quiet_too else len(self._asking))):
            if self._asking:
                key = next(iter(self._asking))
                del self._asking[key]
            else:
                key = self._quiet.popitem()[0]
            yield key


class _Waiting:
    __slots__ = ("client", "received", "sock")

    def __init__(self, sock: socket.socket, client: Address) -> None:
        self.sock = sock
        self.client = client
        self.received = b""


class _ListenerOnly:
    """Where there is no epoll (not Linux): the acceptor waits on its listener alone and
    tries to accept each turn, and sockets are never seen to ask (quiet, newest first)."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener

    def fileno(self) -> int:
        return self._listener.fileno()

    def poll(self, timeout: float) -> list[tuple[int, int]]:
        return [(self._listener.fileno(), 0)]  # an accept that finds none costs little

    def register(self, fd: int, events: int) -> None:
        pass

    def unregister(self, fd: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Pending:
    """A listener's accepted sockets that wait to start, by descriptor."""

    def __init__(
        self,
        listener: socket.socket,
        greeting: Greeting | None,
        max_pending: int,
        evicted: Callable[[], object],
    ) -> None:
        self.greeting = greeting
        self.max_pending = max_pending
        self.evicted = evicted
        self.watch: select.epoll | _ListenerOnly = (
            select.epoll() if hasattr(select, "epoll") else _ListenerOnly(listener)
        )
        self.waiting: dict[int, _Waiting] = {}
        self.order = StartOrder()

    def add(self, sock: socket.socket, client: Address) -> None:
        sock.setblocking(False)
        waiting = _Waiting(sock, client)
        asked = False
        try:
            if self.greeting is not None:
                self.greeting.greet(sock)
                asked = self._read(waiting, first=True)  # later bytes wake the watch
        except OSError:  # gone already
            sock.close()
            return
        fd = sock.fileno()
        self.waiting[fd] = waiting
        self.order.arrived(fd)
        if asked:
            self.order.asked(fd)
        self.watch.register(fd, _WATCHED)

    def stirred(self, fd: int) -> None:
        """The client of pending ``fd`` wrote, or left."""
        waiting = self.waiting.get(fd)
        if waiting is None:
            return
        if self.greeting is None:  # no greeting: the client speaks first
            self.order.asked(fd)
            return
        try:
            asked = self._read(waiting)
        except OSError:  # the client left before its connection started
            self.order.discard(fd)
            del self.waiting[fd]
            self.watch.unregister(fd)
            waiting.sock.close()
            return
        if asked:
            self.order.asked(fd)

    def _read(self, waiting: _Waiting, first: bool = False) -> bool:
        """Read what the client sent; whether it asks something. ``OSError`` if it left.
        ``first``: the socket is not watched yet (its watch will report what is left)."""
        assert self.greeting is not None
        while len(waiting.received) < _READ_MOST:
            wanted = _READ_MOST - len(waiting.received)
            try:
                data = waiting.sock.recv(wanted)
            except BlockingIOError:
                break
            if not data:
                raise ConnectionResetError("the client left")
            waiting.received += data
            if first and len(data) < wanted:  # the socket is empty (see epoll(7)), and
                break  # what comes before it is watched wakes the watch: no failing recv
        return len(waiting.received) >= _READ_MOST or self.greeting.asks(waiting.received)

    def can_make_room(self) -> bool:
        return len(self.waiting) < self.max_pending or self.order.quiet > 0

    def make_room(self) -> None:
        """Close the quiet socket that waited longest if all ``max_pending`` wait."""
        if len(self.waiting) < self.max_pending:
            return
        fd = self.order.oldest_quiet()
        assert fd is not None  # see can_make_room
        self.watch.unregister(fd)
        self.waiting.pop(fd).sock.close()
        self.evicted()

    def take(self, most: int, quiet_too: bool) -> Iterator[_Waiting]:
        for fd in self.order.take(most, quiet_too):
            self.watch.unregister(fd)
            yield self.waiting.pop(fd)

    def close(self) -> None:
        self.watch.close()
        for waiting in self.waiting.values():
            waiting.sock.close()
        self.waiting.clear()


async def accept_forever(
    listener: socket.socket,
    accepted: Accepted,
    *,
    greeting: Greeting | None = None,
    max_pending: int = 4096,
    evicted: Callable[[], object] = lambda: None,
) -> None:
    """Start a connection for every client (non-blocking, TCP_NODELAY), fairly (see the
    module's docstring). When ``max_pending`` wait, a new client closes the quiet one
    that waited longest (``evicted`` counts it). Running out of descriptors pauses
    accepting briefly (logged) instead of failing."""
    pending = _Pending(listener, greeting, max_pending, evicted)
    listening = listener.fileno()
    pending.watch.register(listening, getattr(select, "EPOLLIN", 0))  # level-triggered
    try:
        while True:
            if not pending.waiting:
                await wait_readable(pending.watch.fileno())
            more_arriving = False  # the listen queue may hold more than this turn took
            for fd, _ in pending.watch.poll(0):
                if fd != listening:
                    pending.stirred(fd)
                else:
                    more_arriving = await _accept(listener, pending)
            for waiting in pending.take(_STARTS_PER_TURN, quiet_too=not more_arriving):
                _start(accepted, waiting)
            await checkpoint()  # the connections just started, and the rest run
    finally:
        pending.close()


async def _accept(listener: socket.socket, pending: _Pending) -> bool:
    """Take the clients the listen queue holds, up to ``_ACCEPTS_PER_TURN`` of them,
    making room among the ``max_pending`` waiting if need be; whether it took that
    many (more may wait)."""
    for _ in range(_ACCEPTS_PER_TURN):
        if not pending.can_make_room():  # all asked: the rest wait in the listen queue
            return False
        try:
            sock, addr = listener.accept()
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in _RESOURCE_ERRNOS:
                logger.error("accept failed (%s); pausing briefly", exc)
                await trio.sleep(_BACKOFF_S)
            return False
        pending.make_room()
        pending.add(sock, (addr[0], addr[1]))
    return True


def _start(accepted: Accepted, waiting: _Waiting) -> None:
    sock = waiting.sock
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        local = sock.getsockname()
    except OSError:  # reset before we got to it
        sock.close()
        return
    accepted(sock, waiting.client, (local[0], local[1]), waiting.received)


class Departures:
    """Paces the teardown of connections whose clients left: when thousands leave at
    once (a crowd's process exits), each connection's teardown takes a turn or a few
    of the event loop, and all of them in the same turns would make every other client
    wait the whole time. ``leave_in_turn`` lets ``PER_TURN`` go a turn."""

    __slots__ = ("_leaving", "_pacing", "_turn_budget")
    PER_TURN = 64

    def __init__(self) -> None:
        self._leaving = trio.lowlevel.ParkingLot()
        self._turn_budget = self.PER_TURN  # teardowns still allowed this turn
        self._pacing = False  # a task grants the next turns' budgets

    async def leave_in_turn(self) -> None:
        """Return once this connection may tear down: at once, unless many already
        did this turn."""
        if self._turn_budget:
            self._turn_budget -= 1
            return
        if not self._pacing:
            self._pacing = True
            trio.lowlevel.spawn_system_task(self._pace)
        await self._leaving.park()

    async def _pace(self) -> None:
        try:
            while True:
                await trio.lowlevel.checkpoint()  # a turn passes
                self._turn_budget = self.PER_TURN
                if not self._leaving:
                    return
                self._turn_budget -= len(self._leaving.unpark(count=self.PER_TURN))
        finally:
            self._pacing = False
