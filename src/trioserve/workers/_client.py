"""A front-end worker's end of its link to the core process: calls forwarded under
numbers, their answers matched back (``ipc.Replies``), blocks freed both ways."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

import numpy as np
import trio

from ..ipc import Block, Pending, Replies, SegmentMap, TrioChannel
from ._coalesce import outcomes_of_rows
from ._input_blocks import InputBlocks
from ._wire import (
    ANSWER,
    CANCEL,
    COUNTERS,
    DRAIN,
    FREE,
    INLINE_BYTES,
    OUTCOME,
    PULL,
    Outbound,
    OutputPayload,
    Payload,
    Returned,
    new_arena,
    on_loop_when_gone,
    read,
    root_in_place,
    unwrap,
)

logger = logging.getLogger("trioserve.workers")

Answer = tuple[Any, ...]
WITHDRAWN: Answer = ()  # a single-answer call's answer once its client has left


class Cancellable(Protocol):
    """What a client that leaves calls back (``rest.Request``, ``grpc.Call``)."""

    def cancel_with(self, withdraw: Callable[[], None] | None, /) -> None: ...


class CoreClient:
    """Forwards calls to the core and hands each its answers."""

    def __init__(
        self,
        channel: TrioChannel,
        nursery: trio.Nursery,
        counters: Callable[[], dict[str, dict[str, int]]],
        arena_max_bytes: int,
    ) -> None:
        self.out = Outbound(channel, new_arena(arena_max_bytes))
        self.inputs = InputBlocks(self.out.arena)  # bodies received into it, inputs read
        self.peer = SegmentMap()
        self.replies: Replies[Answer] = Replies()
        self.drain = trio.Event()  # the core asks this worker to drain and exit
        self.forwarded = 0  # calls forwarded: this worker's share of the traffic
        self._nursery = nursery  # for frames sent from synchronous code (cancels, frees)
        self._token = trio.lowlevel.current_trio_token()
        self._counters = counters
        self._frees: list[Block] = []
        # Single-answer calls, numbered below zero (``Replies`` numbers the others).
        self._pending: dict[int, Pending[Answer]] = {}
        self._pending_ids = itertools.count(-1, -1)

    async def run(self, frames: list[tuple[Any, list[int]]]) -> None:
        """Receive until the core closes the link (raises ``ipc.LinkClosed``)."""
        channel = self.out.channel
        while True:
            for message, fds in frames:
                # Only a SEGMENTS frame needs unwrapping, and it has descriptors.
                self._dispatch(unwrap(message, fds, self.peer) if fds else message)
            frames = await channel.receive()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == ANSWER:
            for block in message[2] if len(message) > 2 else ():
                self.inputs.read_by_answer(block)  # before a FREE of it can come
            for call, item, last in message[1]:
                if type(call) is tuple:  # several INFERs' (``_coalesce.py``)
                    self._resolve_rows(call, item)
                elif call < 0:
                    pending = self._pending.pop(call, None)
                    if pending is not None:
                        pending.resolve(item)
                    else:
                        self.release(item)  # the call was withdrawn: nobody reads its blocks
                elif not self.replies.deliver(call, item, last=last):
                    self.release(item)
        elif kind == FREE:
            for block in message[1]:
                self.inputs.free(block)
        elif kind == PULL:
            self._send_soon((COUNTERS, message[1], self._counters()))
        elif kind == DRAIN:
            self.drain.set()
        else:
            logger.error("the core sent an unknown message kind %r", kind)

    def _resolve_rows(self, calls: tuple[int, ...], outcome: Answer) -> None:
        """The INFERs answered by one OUTCOME of them all, each with its own (those
        withdrawn meanwhile have none to resolve; their rows are in the frame)."""
        pending = self._pending
        for call, own in outcomes_of_rows(calls, outcome):
            waiting = pending.pop(call, None)
            if waiting is not None:
                waiting.resolve(own)

    def open(self) -> tuple[int, trio.MemoryReceiveChannel[Answer | BaseException]]:
        self.forwarded += 1
        return self.replies.open()

    def open_pending(self) -> Pending[Answer]:
        """A new single-answer call."""
        self.forwarded += 1
        pending: Pending[Answer] = Pending(next(self._pending_ids))
        self._pending[pending.call] = pending
        return pending

    async def answer(self, pending: Pending[Answer], caller: Cancellable) -> Answer:
        """A single-answer call's answer (``WITHDRAWN`` if its client left meanwhile): a
        client that leaves while it waits (``caller``: its REST request or gRPC call) or
        a cancelled waiter withdraws the call. Once returned, the answer is the caller's:
        a client that leaves then releases nothing of it."""
        caller.cancel_with(partial(self.cancel_pending, pending))
        try:
            return await pending.wait()
        except BaseException:
            self.cancel_pending(pending)
            raise
        finally:
            caller.cancel_with(None)

    def cancel_pending(self, pending: Pending[Answer]) -> None:
        """The client left before its answer was read: the core withdraws the call, and
        its waiter wakes with ``WITHDRAWN``; an answer that came is dropped."""
        if self._pending.pop(pending.call, None) is not None:
            self._send_soon((CANCEL, pending.call))
            pending.resolve(WITHDRAWN)
        elif pending.answer is not None and pending.answer is not WITHDRAWN:
            self.release(pending.answer)
            pending.answer = WITHDRAWN

    def cancel(self, call: int, answers: trio.MemoryReceiveChannel[Answer | BaseException]) -> None:
        """The client left: the core withdraws the call; answers already here are
        dropped (their blocks freed)."""
        self.replies.withdraw(call)
        while True:
            try:
                item = answers.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self.release(item)
        self._send_soon((CANCEL, call))

    def pack_inputs(self, datas: list[bytes | memoryview]) -> list[Payload]:
        """An inference's inputs as they travel: a large one that lies in a body
        received into the arena as the part of it that it is, the others packed (all,
        or none: parts let go of again)."""
        if not self.inputs.receiving:  # no body in the arena: the usual small request
            return self.out.pack_all(datas)
        parts = [self.inputs.part(data) if len(data) >= INLINE_BYTES else None for data in datas]
        try:
            return self.out.pack_all(datas, parts)
        except BaseException:
            for part in parts:
                if part is not None:
                    self.inputs.free(part)
            raise

    def take(self, payload: OutputPayload) -> bytes | memoryview:
        """A payload's bytes; a block's stay valid until ``free(payload)``, an input's
        that an output lies in (``Returned``) until the answer is released."""
        if isinstance(payload, Returned):
            block = payload.block
            return self.out.arena.view(block)[payload.offset : payload.offset + payload.size]
        return read(payload, self.peer)

    def free(self, payload: Payload) -> None:
        if isinstance(payload, Block):
            if not self._frees:
                self._nursery.start_soon(self._send_frees)
            self._frees.append(payload)

    def release(self, item: Answer | BaseException) -> None:
        """Free the blocks of an answer nobody will read (any more): its payloads, or an
        OUTCOME's outputs' (they lie in its list of tensors; nothing else of it does)."""
        if not isinstance(item, tuple) or not item:
            return
        if item[0] == OUTCOME:
            self.release_payloads([tensor[3] for tensor in item[6] or ()])
        else:
            self.release_payloads(item)

    def release_payloads(self, payloads: Iterable[object]) -> None:
        for payload in payloads:
            if type(payload) is Block:  # small payloads ride in the frame
                self.free(payload)
            elif type(payload) is Returned:
                self.inputs.answer_done(payload.block)

    def owned_by(self, array: np.ndarray[Any, Any], payload: OutputPayload) -> None:
        """``array`` was read from ``payload``: its block is given back once neither the
        array nor any view of it is left (a response's parts, in whichever front end's
        queue, are such views), from whichever thread drops the last one; at once if
        the array is a copy."""
        if type(payload) is bytes:
            return
        root = root_in_place(array)
        if root is None:
            self.release_payloads((payload,))
        else:
            on_loop_when_gone(root, self._token, self.release_payloads, (payload,))

    async def _send_frees(self) -> None:
        blocks, self._frees = self._frees, []
        await self.out.send((FREE, blocks))

    def _send_soon(self, message: tuple[Any, ...]) -> None:
        self._nursery.start_soon(self.out.send, message)
