"""Requests that wait on something their client may walk away from, looked at again only
once they have waited a grace period.

Watching a request for its client's disconnect costs more than answering a typical one,
and most are answered within a few milliseconds. So a registration only notes the
request in arrival order (a dict insert, and a delete when it is answered); one sweeper
task hands those still waiting after between one and two ``grace_s`` to ``due``, on a
fixed tick, so its wakeups do not grow with the request rate. The HTTP/1.1 core's hangup
watch (``_http11_hangups.py``) and the ``receive()`` fallback (``_disconnects.py``) both
stand on it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import trio

_Item = TypeVar("_Item")


class GracePeriod(Generic[_Item]):
    """Waiting items by arrival; ``run`` hands each one past ``grace_s`` to ``due``."""

    def __init__(self, grace_s: float, due: Callable[[_Item], None]) -> None:
        self.grace_s = grace_s
        self._due = due
        self._waiting: OrderedDict[_Item, float] = OrderedDict()  # since; oldest first
        self._arrived = trio.Event()

    def arrived(self, item: _Item) -> None:
        """``item`` starts waiting (``forget`` it first if it waits already: it would keep
        its place and hold the sweep of those behind it for a tick)."""
        self._waiting[item] = trio.current_time()
        if not self._arrived.is_set():
            self._arrived.set()

    def forget(self, item: _Item) -> None:
        self._waiting.pop(item, None)

    def __contains__(self, item: _Item) -> bool:
        return item in self._waiting

    async def run(self) -> None:
        """The sweeper: every ``grace_s`` while items wait."""
        while True:
            if not self._waiting:
                self._arrived = trio.Event()
                await self._arrived.wait()
            await trio.sleep(self.grace_s)
            self._hand_over(trio.current_time())

    def _hand_over(self, now: float) -> None:
        # A method of its own so that no local of the long-lived sweeper keeps the last
        # item (and its request's data) alive after the request is answered.
        while self._waiting:
            item, since = next(iter(self._waiting.items()))
            if now - since < self.grace_s:
                break  # the rest are younger still
            del self._waiting[item]
            self._due(item)
