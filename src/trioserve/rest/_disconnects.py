"""A client's disconnect where the HTTP server offers no ``trioserve.cancel_with``.

Our HTTP/1.1 core watches for hangups itself (``_http11_hangups.py``) and hands the app
its ``cancel_with`` in the scope; this is the same interface for any other ASGI server
(Hypercorn), which tells a disconnect only through ``receive()``.

Awaiting ``receive()`` takes a task of its own, which costs more than answering a
typical request. Most requests are answered within a few milliseconds, so none is
watched at first: registrations are kept in arrival order, and one sweeper task looks
again at those still waiting after between one and two ``grace_s``, starting a watcher
task for each. A watcher that sees ``http.disconnect`` calls the registered withdraw.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import trio

from ._asgi import CancelWith, Receive


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
            self._watch.arrived(self)
            return
        self._watch.forget(self)
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None


class ReceiveWatch:
    """Watches waiting requests' ``receive()`` past a grace period (``run``)."""

    def __init__(self, grace_s: float = 0.005) -> None:
        self.grace_s = grace_s
        self._waiting: OrderedDict[_Watched, float] = OrderedDict()  # since; oldest first
        self._arrived = trio.Event()

    def cancel_with(self, receive: Receive) -> CancelWith:
        """The ``cancel_with`` of a request whose disconnect ``receive()`` tells."""
        return _Watched(self, receive).cancel_with

    def arrived(self, watched: _Watched) -> None:
        self._waiting[watched] = trio.current_time()
        self._waiting.move_to_end(watched)
        if not self._arrived.is_set():
            self._arrived.set()

    def forget(self, watched: _Watched) -> None:
        self._waiting.pop(watched, None)

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
        # request (and its tensors) alive after it is answered.
        while self._waiting:
            watched, since = next(iter(self._waiting.items()))
            if now - since < self.grace_s:
                break  # the rest are younger still
            del self._waiting[watched]
            watched.watcher = trio.CancelScope()
            watchers.start_soon(_watch, watched, watched.watcher)


async def _watch(watched: _Watched, scope: trio.CancelScope) -> None:
    with scope:
        while (await watched.receive())["type"] != "http.disconnect":
            pass
        withdraw, watched.withdraw = watched.withdraw, None
        if withdraw is not None:
            withdraw()
