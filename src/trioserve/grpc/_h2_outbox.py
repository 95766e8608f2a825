"""What a connection has to send (``_h2_send.Outgoing``, which the state machine fills),
and the sending of it.

Any task queues frames synchronously (``queue``/``extend``) and ``flush`` sends them at
once as far as the socket takes them: a small call's answer leaves in the one
``sendmsg`` of the task that produced it. What the socket does not take now goes to the
writer task (``write_forever``), so no answering task waits on a slow reader and a
cancelled one cannot leave half a frame behind. ``drain`` waits until all is sent; a
failed socket calls ``on_broken`` once and drops everything queued.

The writer task and its events are made the first time the socket refuses part of a
write: most connections never need them, and an idle connection's objects are what a
full collection of the garbage collector walks (thousands of idle connections at once).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ._h2_frames import trim
from ._h2_send import Outgoing
from ._h2_transport import Transport

Spawn = Callable[[Callable[[], Awaitable[None]]], object]  # a nursery's start_soon


class Outbox(Outgoing):
    __slots__ = (
        "_drained", "_on_broken", "_spawn", "_transport", "_wake", "_writing", "broken",
    )  # fmt: skip

    def __init__(self, transport: Transport, on_broken: Callable[[], None]) -> None:
        super().__init__()
        self._transport = transport
        self._on_broken = on_broken
        self._spawn: Spawn | None = None  # where the writer task runs, once the connection does
        self._writing = False  # the writer task owns the socket until the queue is empty
        self._wake: trio.Event | None = None  # None: no writer task yet
        self._drained: trio.Event | None = None
        self.broken = False

    def start(self, spawn: Spawn) -> None:
        """The connection runs: a writer task, when one is needed, runs under ``spawn``."""
        self._spawn = spawn
        if self._writing:  # a write was refused before: its writer starts now
            spawn(self.write_forever)

    def flush(self) -> None:
        """Send what is queued, as far as the socket takes it now; the rest is the
        writer task's."""
        if self._writing or not self.parts or self.broken:
            return
        try:
            sent = self._transport.try_send(self.parts)
        except OSError:
            self._fail()
            return
        if sent == self.size:  # the usual case: all of it went
            self.parts.clear()
            self.size = 0
            return
        self.size -= sent
        self.parts = trim(self.parts, sent)
        self._writing = True
        if self._wake is None:
            self._wake, self._drained = trio.Event(), trio.Event()
            if self._spawn is not None:
                self._spawn(self.write_forever)
        self._wake.set()

    async def write_forever(self) -> None:
        assert self._wake is not None, "made with the writer"
        assert self._drained is not None
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self.parts:
                parts, self.parts, self.size = self.parts, [], 0
                try:
                    await self._transport.send_all(parts)
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                    self._fail()
                    return
            self._writing = False
            self._drained.set()
            self._drained = trio.Event()

    async def drain(self) -> None:
        """Until everything queued has been sent (or the socket failed)."""
        while (self.parts or self._writing) and not self.broken:
            if not self._writing:
                self.flush()
                continue
            assert self._drained is not None  # made with the writer
            await self._drained.wait()

    def _fail(self) -> None:
        self.broken = True
        self.parts, self.size = [], 0
        if self._drained is not None:
            self._drained.set()
        self._on_broken()
