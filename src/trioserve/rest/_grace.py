"""Requests that wait on something their client may walk away from, looked at again only
once they have waited a grace period.

Watching a request for its client's disconnect costs more than answering a typical one,
and most are answered within a few milliseconds. So a registration only notes the
request (a dict insert, and a delete when it is answered: no clock is read, which would
cost three calls more per request); one sweeper task ticks every ``grace_s`` while
requests wait and hands to ``due`` those that were already waiting at the tick before,
so each is handed over after between one and two ``grace_s`` and the sweeper's wakeups
do not grow with the request rate. The request that wakes an idle sweeper starts its
period with it, and is handed over after exactly ``grace_s``. The HTTP/1.1 core's hangup
watch (``_http11_hangups.py``) and the ``receive()`` fallback (``_disconnects.py``) both
stand on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import trio

_Item = TypeVar("_Item")
_ABSENT = object()


class GracePeriod(Generic[_Item]):
    """Waiting items; ``run`` hands each one waiting past ``grace_s`` to ``due``."""

    def __init__(self, grace_s: float, due: Callable[[_Item], None]) -> None:
        self.grace_s = grace_s
        self._due = due
        self._older: dict[_Item, None] = {}  # waiting since before the last tick
        self._newer: dict[_Item, None] = {}  # arrived since
        self._idle = True  # no tick is coming: the sweeper waits for an arrival
        self._arrived = trio.Event()

    def arrived(self, item: _Item) -> None:
        """``item`` starts waiting (``forget`` it first if it waits already)."""
        self._newer[item] = None
        if self._idle:
            self._idle = False
            self._arrived.set()

    def forget(self, item: _Item) -> None:
        if self._newer.pop(item, _ABSENT) is _ABSENT:
            self._older.pop(item, None)

    def __contains__(self, item: _Item) -> bool:
        return item in self._newer or item in self._older

    async def run(self) -> None:
        """The sweeper: a tick every ``grace_s`` while items wait."""
        while True:
            await self._arrived.wait()
            self._arrived = trio.Event()
            self._older, self._newer = self._newer, {}  # their period starts now
            while self._older:
                await trio.sleep(self.grace_s)
                self._hand_over()
            self._idle = True

    def _hand_over(self) -> None:
        # A method of its own so that no local of the long-lived sweeper keeps the last
        # item (and its request's data) alive after the request is answered.
        # Popped one at a time: what ``due`` does may answer (and forget) another.
        while self._older:
            self._due(self._older.popitem()[0])
        self._older, self._newer = self._newer, {}
