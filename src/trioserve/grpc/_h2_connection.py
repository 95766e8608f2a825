"""One HTTP/2 connection carrying gRPC calls (RFC 9113, server side, h2c or TLS): the
trio driver around the connection's state machine (``_h2_state``, where the protocol
and every defence live).

Shape: one task reads and hands the bytes to the state machine, then acts on its events:
each call runs in a task of its own in the connection's nursery (``_grpc_call``; unary
calls once their request message is complete, streaming calls at their HEADERS);
writes are queued synchronously by whichever task answers and sent at once when the
socket takes them, by a writer task otherwise (``_h2_outbox``). So a small unary call
costs one ``recv`` for its request and one ``sendmsg`` for HEADERS, DATA and trailers
together, and no task ever blocks another on a slow socket.

What the driver adds to the state machine's defences: the reader stops while the state
is ``backlogged`` (the client leaves what we sent unread) and checkpoints after each
``_YIELD_BYTES`` read and each ``YIELD_FRAMES`` frames (its ``backlog``), so a client
whose socket never runs dry does not keep every other client waiting; streaming calls
wait for room in the connection's ``PendingBudget``; a connection that ended flushes for
at most ``_FLUSH_S``. Client mistakes are logged at DEBUG and counted, never as
tracebacks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from typing import cast

import trio

from .._admission import Departures
from .._limits import GrpcLimits
from ._call import Method
from ._errors import GrpcStatus
from ._grpc_call import GrpcStream, run_call
from ._h2_guard import CoreStatistics, IdleRoster
from ._h2_outbox import Outbox
from ._h2_state import BUSY, ENDED, IDLE, REPAID, WINDOW_OPENED, H2State, Signal
from ._h2_stream import H2Stream
from ._h2_transport import Transport

logger = logging.getLogger("trioserve.grpc")

# How long a closing connection may take to flush what it queued.
_FLUSH_S = 5.0
# The reader checkpoints after this much read in a row.
_YIELD_BYTES = 256 * 1024


class _PeerGone(Exception):
    pass


class H2Connection:
    def __init__(
        self,
        transport: Transport,
        methods: Mapping[str, Method],
        limits: GrpcLimits,
        max_message_bytes: int,
        statistics: CoreStatistics,
        roster: IdleRoster,
        departures: Departures,
        *,
        greeted: bytes | None = None,
    ) -> None:
        self._transport = transport
        # The server's opening frames went out as the socket was accepted, and this is
        # what the client had sent then (_core.greet); None: the state sends them.
        self._greeted = greeted
        self._departures = departures
        self._stats = statistics
        self._roster = roster
        self.max_message = max_message_bytes
        self.max_outbox = limits.max_outbox_bytes
        self.outbox = Outbox(transport, self._fail)
        self.state = H2State(
            methods, limits, max_message_bytes, statistics,
            clock=trio.current_time, out=self.outbox, new_stream=partial(GrpcStream, self),
        )  # fmt: skip
        self._reader = trio.CancelScope()
        self._calls: trio.Nursery | None = None
        self._since_yield = 0  # bytes read since the reader last checkpointed
        # Made by whoever waits, set and dropped when it happens (an idle connection
        # holds none: its objects are what a full garbage collection walks).
        self._window: trio.Event | None = None  # the client's windows grew
        self._room: trio.Event | None = None  # owed requests were repaid

    # --- lifetime ------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until the client leaves, the connection fails or idles, or a drain ends."""
        self._roster.idle(self)
        try:
            async with trio.open_nursery() as calls:
                self._calls = calls
                self.outbox.start(calls.start_soon)
                try:
                    with self._reader:
                        await self._read_forever()
                except _PeerGone:
                    await self._departures.leave_in_turn()  # not a whole crowd at once
                self.state.close()
                self.state.events.clear()
                self.outbox.flush()
                with trio.move_on_after(_FLUSH_S):
                    await self.outbox.drain()
                calls.cancel_scope.cancel()
        except Exception:
            logger.exception("gRPC connection failed")
        finally:
            self._roster.gone(self)
            await self._transport.aclose()

    def begin_shutdown(self) -> None:
        """Drain: GOAWAY now (no new streams), close once the open ones are done."""
        self.state.begin_shutdown()
        self._dispatch()
        self.outbox.flush()

    def idle_tick(self, limit: int) -> None:
        """One tick of the server's sweeper (``H2State.idle_tick``)."""
        self.state.idle_tick(limit)
        self._dispatch()

    def close_idle(self, counter: str) -> None:
        """Close with GOAWAY(NO_ERROR) if no call is open, counted in ``counter``."""
        self.state.close_idle(counter)
        self._dispatch()

    # --- reading -------------------------------------------------------------------------

    async def _read_forever(self) -> None:
        state = self.state
        transport = self._transport
        greeted, self._greeted = self._greeted, None  # its bytes are the reader's now
        if greeted is not None:
            state.opening_sent = True
            state.receive_data(greeted)
            self._dispatch()
            self.outbox.flush()
        while not state.ended:
            view = state.direct_view()
            if view is None:
                state.receive_data(await self._recv())
                while state.backlog:  # a run of small frames: let others run between
                    self._dispatch()
                    self.outbox.flush()
                    await self._pace(checkpoint=True)
                    state.receive_data(b"")
            else:
                if self._since_yield >= _YIELD_BYTES or self.outbox.parts:
                    await self._pace()
                received = await transport.recv_into(view)
                if not received:
                    raise _PeerGone
                self._since_yield += received
                state.received_directly(view, received)
            self._dispatch()
            self.outbox.flush()

    async def _recv(self) -> bytes:
        if self._since_yield >= _YIELD_BYTES or self.outbox.parts:
            await self._pace()  # a call only when there may be something to wait for
        data = await self._transport.recv()
        if not data:
            raise _PeerGone
        self._since_yield += len(data)
        return data

    async def _pace(self, *, checkpoint: bool = False) -> None:
        """Before reading more: wait while the client leaves what we sent unread (each
        frame read may queue an answer: a PING its ACK), and give other tasks their turn
        after a run of reads."""
        if self.state.backlogged:
            self._stats.outbox_pauses += 1
            self.outbox.flush()
            await self.outbox.drain()
        if checkpoint or self._since_yield >= _YIELD_BYTES:
            self._since_yield = 0
            await trio.lowlevel.checkpoint()

    def _dispatch(self) -> None:
        """Act on what the state machine asked for."""
        events = self.state.events
        if not events:
            return
        self.state.events = []
        for event in events:
            if type(event) is not Signal:  # a stream: its call is ready to run
                assert self._calls is not None
                self._calls.start_soon(run_call, self, cast(GrpcStream, event))
            elif event is WINDOW_OPENED:
                if self._window is not None:
                    self._window.set()
                    self._window = None
            elif event is REPAID:
                if self._room is not None:
                    self._room.set()
                    self._room = None
            elif event is IDLE:
                self._roster.idle(self)
            elif event is BUSY:
                self._roster.busy(self)
            elif event is ENDED:
                self._reader.cancel()

    # --- what calls ask of it (``_grpc_call.CallHost``) ----------------------------------

    async def admit(self, stream: H2Stream, size: int) -> None:
        pending = self.state.pending
        if pending.must_wait(bool(stream.owed), size):
            pending.pauses += 1
            pending.waiting += 1
            try:
                while pending.must_wait(True, size):
                    if self._room is None:
                        self._room = trio.Event()
                    await self._room.wait()
            finally:
                pending.waiting -= 1
        self.state.owe(stream, size)

    def repaid(self, stream: H2Stream) -> None:
        self.state.repaid(stream)
        self._dispatch()
        self.outbox.flush()

    async def window_opened(self) -> None:
        if self._window is None:
            self._window = trio.Event()
        await self._window.wait()

    def finish(self, stream: H2Stream, status: GrpcStatus, message: str) -> None:
        self.state.finish(stream, status, message)
        self._dispatch()
        self.outbox.flush()

    # --- writing -------------------------------------------------------------------------

    def _fail(self) -> None:
        """The socket failed: nothing more can be sent, so the connection ends."""
        self._reader.cancel()
        for stream in list(self.state.streams.values()):
            self.state.drop(stream)
        self._dispatch()
