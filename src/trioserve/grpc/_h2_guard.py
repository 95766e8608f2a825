"""What HTTP/2 connections let a client cost the server, counted apart from the
protocol work in ``_h2_state``: the header block being assembled (bounded in bytes
and in frames), the budget of stream resets, the requests a connection holds for its
client, the server's idle connections, and the counters of what clients did wrong.

A bound a client passes ends its connection with GOAWAY(ENHANCE_YOUR_CALM) naming the
``CoreStatistics`` counter that records it, or holds the client through flow control.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from . import _h2_frames as h2


@dataclass
class CoreStatistics:
    """Counts a server's connections keep of what clients did wrong."""

    protocol_errors: int = 0  # connections ended by GOAWAY with an error code
    stream_errors: int = 0  # streams reset by us
    refused_streams: int = 0  # over MAX_CONCURRENT_STREAMS or after GOAWAY
    calm_goaways: int = 0  # connections ended for too many streams reset
    idle_closed: int = 0  # connections closed for being idle
    refused_connections: int = 0  # closed on accept, over the connection limit
    idle_evicted: int = 0  # idle connections closed to make room for new ones
    continuation_floods: int = 0  # connections ended for too many CONTINUATION frames
    hpack_cache_evictions: int = 0  # header blocks dropped from full caches (on close)
    outbox_pauses: int = 0  # times a reader stopped while its client left bytes unread
    pending_pauses: int = 0  # times a streaming call waited for its connection's budget


def count(statistics: CoreStatistics, counter: str) -> None:
    """One more of ``counter`` (a ``CoreStatistics`` field named by a defence)."""
    setattr(statistics, counter, getattr(statistics, counter) + 1)


class ResetBudget:
    """A token bucket of stream resets: those the client sends (rapid reset), the
    streams refused, and those the server sends for a client's stream error (a client
    can provoke them as cheaply: a WINDOW_UPDATE of 0 after each call). Each costs the
    server a call set up and torn down, so an empty bucket ends the connection."""

    __slots__ = ("_burst", "_clock", "_rate", "_time", "_tokens")

    def __init__(self, burst: int, rate: float, clock: Callable[[], float]) -> None:
        self._burst = float(burst)
        self._rate = rate
        self._clock = clock
        self._tokens = float(burst)
        self._time = clock()

    def charge(self) -> None:
        now = self._clock()
        tokens = self._tokens + (now - self._time) * self._rate
        self._tokens = min(self._burst, tokens) - 1
        self._time = now
        if self._tokens < 0:
            raise h2.GoawayError(h2.ENHANCE_YOUR_CALM, "too many streams reset", "calm_goaways")


class HeaderBlock:
    """A header block arriving as HEADERS then CONTINUATION frames, bounded before it is
    decoded: in bytes, and in frames, empty ones included (each costs a frame's work
    however little it carries)."""

    __slots__ = (
        "_fragments", "_frames", "_max_bytes", "_max_frames", "flags", "open", "stream_id",
    )  # fmt: skip

    def __init__(self, max_bytes: int, max_frames: int) -> None:
        self._max_bytes = max_bytes
        self._max_frames = max_frames  # CONTINUATION frames after the HEADERS
        self._fragments = bytearray()
        self._frames = 0  # 0: no block open
        self.open = False  # a block waits for its CONTINUATION frames
        self.flags = 0  # the HEADERS frame's (END_STREAM)
        self.stream_id = 0

    def check(self, length: int) -> None:
        """Before a HEADERS or CONTINUATION payload of ``length`` is read."""
        if len(self._fragments) + length > self._max_bytes:
            raise h2.GoawayError(h2.ENHANCE_YOUR_CALM, "header block too large")

    def begin(self, flags: int, stream_id: int, fragment: bytes) -> None:
        self._fragments = bytearray(fragment)
        self._frames = 1
        self.open = True
        self.flags = flags
        self.stream_id = stream_id

    def add(self, flags: int, stream_id: int, fragment: bytes) -> bytes | None:
        """A CONTINUATION's fragment; the whole block once it ends (END_HEADERS)."""
        if not self._frames or stream_id != self.stream_id:
            raise h2.GoawayError(h2.PROTOCOL_ERROR, "CONTINUATION out of place")
        if self._frames > self._max_frames:
            raise h2.GoawayError(
                h2.ENHANCE_YOUR_CALM, "too many CONTINUATION frames", "continuation_floods"
            )
        self._frames += 1
        self._fragments += fragment
        if not flags & h2.END_HEADERS:
            return None
        block = bytes(self._fragments)
        self.clear()
        return block

    def clear(self) -> None:
        self._fragments = bytearray()
        self._frames = 0
        self.open = False


def header_fragment(flags: int, payload: bytes) -> bytes:
    """A HEADERS frame's header block fragment, without its padding and priority."""
    start = 0
    end = len(payload)
    if flags & h2.PADDED:
        if not payload:
            raise h2.GoawayError(h2.PROTOCOL_ERROR, "padded HEADERS without a pad length")
        end -= payload[0]
        start = 1
    if flags & h2.PRIORITY_FLAG:
        start += 5
    if end < start:
        raise h2.GoawayError(h2.PROTOCOL_ERROR, "HEADERS padding longer than the frame")
    return payload[start:end]


class PendingBudget:
    """Bytes a client has the connection hold for it besides the messages it is still
    sending: requests received and not yet taken by their calls (``queued``), and those
    streaming calls took and have not answered yet (``owed``: a request is owed until its
    call writes its next reply, which waits while the client does not read).

    Past ``limit`` the connection stops reopening its receive window, and streaming calls
    take no new request, except a call that owes nothing (so that one request larger
    than the limit still goes through): a client that sends and never reads waits on
    flow control instead of piling up requests and their answers. The waiting is the
    driver's (``_h2_connection``); this is the accounting.
    """

    __slots__ = ("_limit", "owed", "pauses", "queued", "waiting")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.queued = 0
        self.owed = 0
        self.pauses = 0  # times a call waited
        self.waiting = 0  # calls waiting now

    @property
    def full(self) -> bool:
        return self.queued + self.owed > self._limit

    def must_wait(self, owes: bool, size: int) -> bool:
        """Whether a call (``owes``: one with requests unanswered) must wait before it
        takes a request of ``size`` bytes."""
        return owes and self.owed > 0 and self.owed + size > self._limit


class _Closable(Protocol):
    def close_idle(self, counter: str) -> None: ...


class IdleRoster:
    """A server's connections with no call open, in the order they became idle, so that
    past a share of the connection limit the one idle longest gives way to a new
    client (closed with GOAWAY) instead of the new client being refused."""

    __slots__ = ("_idle",)

    def __init__(self) -> None:
        self._idle: dict[_Closable, None] = {}

    def idle(self, connection: _Closable) -> None:
        self._idle.pop(connection, None)
        self._idle[connection] = None

    def busy(self, connection: _Closable) -> None:
        self._idle.pop(connection, None)

    gone = busy

    def evict(self) -> None:
        """Close the connection idle the longest, if any is."""
        for connection in self._idle:
            del self._idle[connection]
            connection.close_idle("idle_evicted")
            return
