"""Answers matched to the calls that wait for them, by call id.

A call may get a stream of answers (a decoupled model's responses: ``Replies``, a memory
channel per call) or exactly one (``PendingCalls``: the caller parks on a ``Pending``,
which costs a tenth of what a channel does). The link's receiving task delivers each
answer without waiting, and when the link dies every call still open gets the link's
error as its last answer, so no caller waits forever.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class Pending(Generic[T]):
    """The one answer one task awaits: the task parks until it comes."""

    __slots__ = ("answer", "call", "task")

    def __init__(self, call: int) -> None:
        self.call = call
        self.answer: T | None = None
        self.task: trio.lowlevel.Task | None = None

    async def wait(self) -> T:
        if self.answer is None:
            self.task = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        assert self.answer is not None
        return self.answer

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self.task = None
        return trio.lowlevel.Abort.SUCCEEDED

    def resolve(self, answer: T) -> None:
        self.answer = answer
        task, self.task = self.task, None
        if task is not None:
            trio.lowlevel.reschedule(task)


class PendingCalls(Generic[T]):
    """Calls that get one answer each (or an exception, their failure), by call id."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: dict[int, Pending[T | BaseException]] = {}

    def open(self) -> Pending[T | BaseException]:
        pending: Pending[T | BaseException] = Pending(next(self._ids))
        self._open[pending.call] = pending
        return pending

    def deliver(self, call_id: int, answer: T | BaseException) -> bool:
        """Hand ``answer`` to the call; False if the call is no longer open (withdrawn)."""
        pending = self._open.pop(call_id, None)
        if pending is None:
            return False
        pending.resolve(answer)
        return True

    def withdraw(self, call_id: int) -> None:
        """The caller stopped waiting; its answer is dropped."""
        self._open.pop(call_id, None)

    def fail_all(self, error: BaseException) -> None:
        calls, self._open = self._open, {}
        for pending in calls.values():
            pending.resolve(error)


class Replies(Generic[T]):
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: dict[int, trio.MemorySendChannel[T | BaseException]] = {}

    def open(self) -> tuple[int, trio.MemoryReceiveChannel[T | BaseException]]:
        """A new call id, and where its answers arrive (an exception being a failure)."""
        call_id = next(self._ids)
        # Not ``open_memory_channel[...]``: subscripting at run time builds a union type
        # on every call.
        send: trio.MemorySendChannel[T | BaseException]
        receive: trio.MemoryReceiveChannel[T | BaseException]
        send, receive = trio.open_memory_channel(math.inf)
        self._open[call_id] = send
        return call_id, receive

    def deliver(self, call_id: int, answer: T | BaseException, *, last: bool = True) -> bool:
        """Hand ``answer`` to the call; False if the call is no longer open (withdrawn)."""
        send = self._open.get(call_id)
        if send is None:
            return False
        try:
            send.send_nowait(answer)
        except trio.BrokenResourceError:  # the caller closed its end without withdrawing
            last = True
        if last:
            del self._open[call_id]
            send.close()
        return True

    def withdraw(self, call_id: int) -> None:
        """The caller stopped waiting; later answers to the call are dropped."""
        send = self._open.pop(call_id, None)
        if send is not None:
            send.close()

    def fail_all(self, error: BaseException) -> None:
        calls, self._open = self._open, {}
        for send in calls.values():
            with send, contextlib.suppress(trio.BrokenResourceError):
                send.send_nowait(error)

    def __len__(self) -> int:
        return len(self._open)
