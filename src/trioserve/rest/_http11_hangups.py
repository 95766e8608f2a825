"""Clients that hang up while their request waits: the core's ``trioserve.cancel_with``.

An app that waits on something it can give up (a queued inference, a generation) hands
the core what to call if the client goes away, through the scope extension
``CANCEL_WITH`` (``_asgi.py``): ``cancel_with(withdraw)`` while it waits,
``cancel_with(None)`` once the wait is over; the end of the response clears it too.
That is the contract of gRPC's ``Call.cancel_with``, so REST's and gRPC's watches are
twins (``rest/_endpoints.py``, ``grpc/_methods.py``).

Noticing a hangup must cost a request next to nothing: under load (256 connections,
each request tens of milliseconds in its model's queue) every request outlives the
grace period (``_grace.py``), and a watcher task per request (its spawn, cancel scope,
epoll registration and cancellation) doubled the CPU a request costs. So the socket of
a request past its grace period joins the server's epoll set, once per connection and
edge-triggered, reporting only the peer's hangup (EPOLLRDHUP, EPOLLHUP), never
pipelined input. A request then costs no task and no system call. A hangup calls the waiting ``withdraw`` at once, or at the end of the grace
period of a request that arrived on a connection already hung up, and marks the
connection's peer closed: what ``receive()`` would have learnt from the socket's EOF (a
half-close included), so the app that gives up answers nobody and the connection closes.

Without epoll (not Linux) nothing is polled; ``receive()`` still tells the disconnect.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Protocol

import trio

from ._grace import GracePeriod

_HANGUP_EVENTS = (
    getattr(select, "EPOLLRDHUP", 0)
    | getattr(select, "EPOLLHUP", 0)
    | getattr(select, "EPOLLET", 0)
)


class Peer(Protocol):
    """What the watch uses of a connection (``_http11.Connection``)."""

    peer_closed: bool

    @property
    def fd(self) -> int: ...


class CancelHook:
    """One connection's ``cancel_with``: what to call if its client hangs up."""

    __slots__ = ("_hangups", "fd", "hung_up", "joined", "peer", "withdraw")

    def __init__(self, hangups: Hangups, peer: Peer) -> None:
        self._hangups = hangups
        self.peer = peer
        self.fd = peer.fd
        self.withdraw: Callable[[], None] | None = None  # the waiting request's
        self.joined = False  # its socket is in the hangup set
        self.hung_up = False

    def cancel_with(self, withdraw: Callable[[], None] | None) -> None:
        """Call ``withdraw`` if the client hangs up while the request waits (None: the
        wait is over)."""
        self.withdraw = withdraw
        if withdraw is None:
            self._hangups.waiting.forget(self)
        else:
            self._hangups.waiting.arrived(self)


class Hangups:
    """The server's hangup watch: its grace period and its epoll set (``run``)."""

    def __init__(self, grace_s: float = 0.005) -> None:
        self.waiting = GracePeriod(grace_s, self._past_grace)
        self._set: select.epoll | None = None  # opened by run(), on Linux
        self._joined: dict[int, CancelHook] = {}  # by fd: the connections in the set

    def hook(self, peer: Peer) -> CancelHook:
        return CancelHook(self, peer)

    def closed(self, hook: CancelHook) -> None:
        """The connection is over: its socket left the set as it closed."""
        hook.withdraw = None
        self.waiting.forget(hook)
        if self._joined.get(hook.fd) is hook:
            del self._joined[hook.fd]

    async def run(self) -> None:
        """The grace period's sweeper, and beside it the wait on the epoll set."""
        if hasattr(select, "epoll"):  # Linux
            self._set = select.epoll()
        try:
            async with trio.open_nursery() as nursery:
                if self._set is not None:
                    nursery.start_soon(self._wait_hangups, self._set)
                await self.waiting.run()
        finally:
            if self._set is not None:
                self._set.close()
                self._set = None
            for hook in self._joined.values():
                hook.joined = False
            self._joined.clear()

    def _past_grace(self, hook: CancelHook) -> None:
        """A request still waiting after its grace period: withdrawn if its client hung
        up already, else its socket polled from now on."""
        if hook.hung_up:
            _withdraw(hook)
        elif not hook.joined and self._set is not None:
            try:
                # Edge-triggered: reported once; a hangup that came first is reported now.
                self._set.register(hook.fd, _HANGUP_EVENTS)
            except OSError:
                return  # e.g. the socket is already gone: receive() tells
            hook.joined = True
            self._joined[hook.fd] = hook

    async def _wait_hangups(self, hangups: select.epoll) -> None:
        while True:
            await trio.lowlevel.wait_readable(hangups.fileno())
            for fd, _ in hangups.poll(0):
                hook = self._joined.get(fd)
                if hook is None:
                    continue
                hook.hung_up = True
                if hook not in self.waiting:  # else withdrawn once its grace period ends
                    _withdraw(hook)


def _withdraw(hook: CancelHook) -> None:
    withdraw, hook.withdraw = hook.withdraw, None
    if withdraw is not None:
        hook.peer.peer_closed = True  # as receive() marks it on EOF: no keep-alive
        withdraw()
