"""Answers matched to the calls that wait for them, by call id.

A call may get one answer or a stream of them (a decoupled model's responses); the
link's receiving task delivers each without waiting, and when the link dies every
call still open gets the link's error as its last answer, so no caller waits forever.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Generic, TypeVar

import trio

T = TypeVar("T")


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
