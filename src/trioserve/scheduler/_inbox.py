"""The batcher's inbox: many producers, one consumer that takes everything at once.

A memory channel would do, but every request passes through here: ``put`` is a list
append (plus waking the consumer if it sleeps) and ``take`` hands over the whole backlog
in one call, instead of one ``receive_nowait`` per message and a ``WouldBlock`` at the end.
"""

from __future__ import annotations

import math
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class Inbox(Generic[T]):
    """An unbounded queue for exactly one consuming task."""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._consumer: trio.lowlevel.Task | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> None:
        """Never blocks."""
        self._items.append(item)
        consumer = self._consumer
        if consumer is not None:
            self._consumer = None
            trio.lowlevel.reschedule(consumer)

    async def take(self, deadline: float = math.inf) -> list[T]:
        """Everything put so far, oldest first; while nothing is, wait for the first item
        or for ``deadline`` (then the list is empty).

        With a backlog it returns without yielding: the consumer decides and comes back,
        and it sleeps as soon as the producers stop.
        """
        if not self._items:
            if self._consumer is not None:
                raise RuntimeError("Inbox.take is for one consuming task")
            self._consumer = trio.lowlevel.current_task()
            if deadline == math.inf:
                await trio.lowlevel.wait_task_rescheduled(self._abort)
            else:
                with trio.move_on_at(deadline):
                    await trio.lowlevel.wait_task_rescheduled(self._abort)
        items, self._items = self._items, []
        return items

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self._consumer = None
        return trio.lowlevel.Abort.SUCCEEDED
