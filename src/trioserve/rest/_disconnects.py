"""Withdrawing queued requests whose HTTP client went away.

Noticing a disconnect means awaiting the request's ``receive()`` in a task of its own,
which costs more than answering a typical request. Most requests are answered within a
few milliseconds, so none is watched at first: requests are tracked in arrival order,
and one sweeper task looks again at a request still waiting after between one and two
``grace_s``. A watcher that sees the disconnect withdraws the request.

Under load every request outlives the grace period (at 256 connections each waits tens of
milliseconds in its model's queue), and a watcher task per request (its spawn, cancel
scope, epoll registration and cancellation) doubled the CPU a request costs. So when the
HTTP server names the request's socket (the ``HANGUP_FD`` scope extension), the sweeper
polls it instead: the socket joins an epoll set of this watch's own, once per connection
and edge-triggered, that reports only the peer's hangup (EPOLLRDHUP, EPOLLHUP), never
pipelined input. A request then costs no task and no system call; a watcher starts only
for a socket that hung up, and still learns the disconnect through ``receive()``, so the
HTTP server sees it as it would with any watcher.
"""

from __future__ import annotations

import select
from collections import OrderedDict
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ._app import Request
from ._asgi import Receive

_HANGUP_EVENTS = (
    getattr(select, "EPOLLRDHUP", 0)
    | getattr(select, "EPOLLHUP", 0)
    | getattr(select, "EPOLLET", 0)
)
_SOCKET_KEY = "disconnect_watch"


class Withdrawable(Protocol):
    """What the watch withdraws: a model's ticket, or a call a front-end worker
    process forwarded to the core process."""

    def withdraw(self) -> None: ...  # where a connection's _Socket lives in its hangup hint


@dataclass(eq=False, slots=True)
class _Entry:
    since: float
    ticket: Withdrawable
    receive: Receive
    hint: MutableMapping[str, Any] | None  # the connection's HANGUP_FD extension, if any
    watcher: trio.CancelScope | None = None

    @property
    def polled(self) -> bool:
        """Its socket reports the hangup to the watch."""
        sock = None if self.hint is None else self.hint.get(_SOCKET_KEY)
        return sock is not None and sock.polled is self


@dataclass(eq=False, slots=True)
class _Socket:
    """A connection's socket in the hangup set (it leaves when the socket closes)."""

    hangups: select.epoll  # the set it joined
    hung_up: bool = False
    polled: _Entry | None = None  # the request now waiting on it, past its grace period


class DisconnectWatch:
    def __init__(self, grace_s: float = 0.005) -> None:
        self.grace_s = grace_s
        self._waiting: OrderedDict[Withdrawable, _Entry] = OrderedDict()  # oldest first, unwatched
        self._arrived = trio.Event()
        self._hangups: select.epoll | None = None  # opened by run(), on Linux
        # fd -> the last connection that joined the hangup set with it. A closed socket
        # leaves the set by itself, so an entry may be stale until its fd is reused.
        self._sockets: dict[int, _Socket] = {}

    def track(self, ticket: Withdrawable, request: Request) -> _Entry:
        entry = _Entry(trio.current_time(), ticket, request.receive, request.hangup)
        self._waiting[ticket] = entry
        if not self._arrived.is_set():
            self._arrived.set()
        return entry

    def untrack(self, ticket: Withdrawable, entry: _Entry) -> None:
        """The request is answered (or abandoned): stop tracking or watching it."""
        if self._waiting.pop(ticket, None) is not None:
            return
        if entry.polled:
            assert entry.hint is not None
            entry.hint[_SOCKET_KEY].polled = None
        elif entry.watcher is not None:
            entry.watcher.cancel()

    async def run(self) -> None:
        """The sweeper: every ``grace_s`` while requests wait, watch those that waited that
        long (a fixed tick, so its wakeups do not grow with the request rate)."""
        if hasattr(select, "epoll"):  # Linux
            self._hangups = select.epoll()
        try:
            async with trio.open_nursery() as watchers:
                if self._hangups is not None:
                    watchers.start_soon(self._watch_hangups, watchers, self._hangups)
                while True:
                    if not self._waiting:
                        self._arrived = trio.Event()
                        await self._arrived.wait()
                    await trio.sleep(self.grace_s)
                    self._watch_waited(watchers, trio.current_time())
        finally:
            if self._hangups is not None:
                self._hangups.close()
                self._hangups = None
            for sock in self._sockets.values():
                sock.polled = None
            self._sockets.clear()

    def _watch_waited(self, watchers: trio.Nursery, now: float) -> None:
        # A method of its own so that no local of the long-lived sweeper keeps the last
        # ticket (and its request's tensors) alive after the request is answered.
        while self._waiting:
            ticket, entry = next(iter(self._waiting.items()))
            if now - entry.since < self.grace_s:
                break  # the rest are younger still
            del self._waiting[ticket]
            sock = None if entry.hint is None else self._socket(entry.hint)
            if sock is not None and not sock.hung_up:
                sock.polled = entry
            else:
                self._start_watcher(watchers, entry)

    def _socket(self, hint: MutableMapping[str, Any]) -> _Socket | None:
        """The connection's socket in the hangup set, joining it on first use."""
        sock: _Socket | None = hint.get(_SOCKET_KEY)
        if sock is not None and sock.hangups is self._hangups:
            return sock
        if self._hangups is None:
            return None
        fd = int(hint["fd"])
        try:
            # Edge-triggered: reported once; a hangup that came first is reported now.
            self._hangups.register(fd, _HANGUP_EVENTS)
        except OSError:
            return None  # e.g. the socket is already gone: a watcher finds out
        hint[_SOCKET_KEY] = self._sockets[fd] = sock = _Socket(self._hangups)
        return sock

    def _start_watcher(self, watchers: trio.Nursery, entry: _Entry) -> None:
        entry.watcher = trio.CancelScope()
        watchers.start_soon(_watch, entry.ticket, entry.receive, entry.watcher)

    async def _watch_hangups(self, watchers: trio.Nursery, hangups: select.epoll) -> None:
        """Hand the request waiting on a socket that hung up to a watcher."""
        while True:
            await trio.lowlevel.wait_readable(hangups.fileno())
            for fd, _ in hangups.poll(0):
                sock = self._sockets.get(fd)
                if sock is None:
                    continue
                sock.hung_up = True
                entry, sock.polled = sock.polled, None
                if entry is not None:
                    self._start_watcher(watchers, entry)


async def _watch(ticket: Withdrawable, receive: Receive, scope: trio.CancelScope) -> None:
    with scope:
        while (await receive())["type"] != "http.disconnect":
            pass
        ticket.withdraw()  # a no-op if the answer came first
