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
        self._forever = False  # the consumer waits with no deadline

    def __len__(self) -> int:
        return len(self._items)

    @property
    def sleeping(self) -> bool:
        """Whether the consumer waits for an item with no deadline."""
        return self._forever and self._consumer is not None

    def put_quietly(self, item: T) -> None:
        """Put ``item`` without waking the consumer (someone else takes it)."""
        self._items.append(item)

    def take_nowait(self) -> list[T]:
        """Everything put so far, oldest first, without waiting."""
        items, self._items = self._items, []
        return items

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
            self._forever = deadline == math.inf
            if deadline == math.inf:
                await trio.lowlevel.wait_task_rescheduled(self._abort)
            else:
                with trio.move_on_at(deadline):
                    await trio.lowlevel.wait_task_rescheduled(self._abort)
        return self.take_nowait()

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self._consumer = None
        return trio.lowlevel.Abort.SUCCEEDED
