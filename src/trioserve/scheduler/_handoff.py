"""Batches from the batcher to the model instances' tasks.

A memory channel would do, but it costs a ``WouldBlock`` raised and caught, and its
statistics kept, on every batch. The batcher only hands out a batch when it knows an
instance is idle, and an idle instance is parked in ``get``: ``put`` resumes it directly
with the batch. Items only queue before the instances first get to ``get``.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import outcome
import trio

T = TypeVar("T")


class Handoff(Generic[T]):
    """An unbounded queue whose items go straight to a waiting consumer task."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._consumers: deque[trio.lowlevel.Task] = deque()  # parked in get, oldest first

    def put(self, item: T) -> None:
        """Never blocks."""
        if self._consumers:
            trio.lowlevel.reschedule(self._consumers.popleft(), outcome.Value(item))
        else:
            self._items.append(item)

    @property
    def waiting(self) -> bool:
        """Whether a consumer is parked in ``get``."""
        return bool(self._consumers)

    def take_nowait(self) -> T | None:
        """An item already handed over (e.g. by this consumer itself), without waiting."""
        return self._items.popleft() if self._items else None

    async def get(self) -> T:
        if self._items:
            item = self._items.popleft()
            await trio.lowlevel.cancel_shielded_checkpoint()  # taken: must not be lost
            return item
        task = trio.lowlevel.current_task()
        self._consumers.append(task)

        def abort(_: object) -> trio.lowlevel.Abort:
            self._consumers.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        handed: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return handed
