"""Withdrawing queued requests whose HTTP client went away.

Noticing a disconnect means awaiting the request's ``receive()`` in a task of its own,
which costs more than answering a typical request. Most requests are answered within a
few milliseconds, so none is watched at first: requests are tracked in arrival order,
and one sweeper task starts a watcher only for a request still waiting after between one
and two ``grace_s``. A watcher that sees the disconnect withdraws the request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import trio

from .._repository import Ticket
from ._asgi import Receive


@dataclass(eq=False, slots=True)
class _Entry:
    since: float
    receive: Receive
    watcher: trio.CancelScope | None = None


class DisconnectWatch:
    def __init__(self, grace_s: float = 0.005) -> None:
        self.grace_s = grace_s
        self._waiting: OrderedDict[Ticket, _Entry] = OrderedDict()  # oldest first, unwatched
        self._arrived = trio.Event()

    def track(self, ticket: Ticket, receive: Receive) -> _Entry:
        entry = _Entry(trio.current_time(), receive)
        self._waiting[ticket] = entry
        if not self._arrived.is_set():
            self._arrived.set()
        return entry

    def untrack(self, ticket: Ticket, entry: _Entry) -> None:
        """The request is answered (or abandoned): stop tracking or watching it."""
        if self._waiting.pop(ticket, None) is None and entry.watcher is not None:
            entry.watcher.cancel()

    async def run(self) -> None:
        """The sweeper: every ``grace_s`` while requests wait, watch those that waited that
        long (a fixed tick, so its wakeups do not grow with the request rate)."""
        async with trio.open_nursery() as watchers:
            while True:
                if not self._waiting:
                    self._arrived = trio.Event()
                    await self._arrived.wait()
                await trio.sleep(self.grace_s)
                self._watch_waited(watchers, trio.current_time())

    def _watch_waited(self, watchers: trio.Nursery, now: float) -> None:
        # A method of its own so that no local of the long-lived sweeper keeps the last
        # ticket (and its request's tensors) alive after the request is answered.
        while self._waiting:
            ticket, entry = next(iter(self._waiting.items()))
            if now - entry.since < self.grace_s:
                break  # the rest are younger still
            del self._waiting[ticket]
            entry.watcher = trio.CancelScope()
            watchers.start_soon(_watch, ticket, entry.receive, entry.watcher)


async def _watch(ticket: Ticket, receive: Receive, scope: trio.CancelScope) -> None:
    with scope:
        while (await receive())["type"] != "http.disconnect":
            pass
        ticket.withdraw()  # a no-op if the answer came first
