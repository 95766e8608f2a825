"""A client's disconnect where the HTTP server offers no ``trioserve.cancel_with``.

Our HTTP/1.1 core watches for hangups itself (``_http11_hangups.py``) and hands the app
its ``cancel_with`` in the scope; this is the same interface for any other ASGI server
(Hypercorn), which tells a disconnect only through ``receive()``.

Awaiting ``receive()`` takes a task of its own, which costs more than answering a
typical request, so only a request still waiting after its grace period (``_grace.py``)
gets a watcher task. A watcher that sees ``http.disconnect`` calls the registered
withdraw.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from ._asgi import CancelWith, Receive
from ._grace import GracePeriod


class _Watched:
    """One request's registration: its ``cancel_with``."""

    __slots__ = ("_watch", "receive", "watcher", "withdraw")

    def __init__(self, watch: ReceiveWatch, receive: Receive) -> None:
        self._watch = watch
        self.receive = receive
        self.withdraw: Callable[[], None] | None = None
        self.watcher: trio.CancelScope | None = None  # once past its grace period

    def cancel_with(self, withdraw: Callable[[], None] | None) -> None:
        self.withdraw = withdraw
        if withdraw is not None:
            self._watch.waiting.arrived(self)
            return
        self._watch.waiting.forget(self)
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None


class ReceiveWatch:
    """Watches waiting requests' ``receive()`` past a grace period (``run``)."""

    def __init__(self, grace_s: float = 0.005) -> None:
        self.waiting = GracePeriod(grace_s, self._past_grace)
        self._watchers: trio.Nursery | None = None

    def cancel_with(self, receive: Receive) -> CancelWith:
        """The ``cancel_with`` of a request whose disconnect ``receive()`` tells."""
        return _Watched(self, receive).cancel_with

    async def run(self) -> None:
        async with trio.open_nursery() as watchers:
            self._watchers = watchers
            try:
                await self.waiting.run()
            finally:
                self._watchers = None

    def _past_grace(self, watched: _Watched) -> None:
        assert self._watchers is not None, "the grace period ends only while run() runs"
        watched.watcher = trio.CancelScope()
        self._watchers.start_soon(_watch, watched, watched.watcher)


async def _watch(watched: _Watched, scope: trio.CancelScope) -> None:
    with scope:
        while (await watched.receive())["type"] != "http.disconnect":
            pass
        withdraw, watched.withdraw = watched.withdraw, None
        if withdraw is not None:
            withdraw()
