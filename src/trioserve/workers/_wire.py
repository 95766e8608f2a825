"""What the core process and its front-end workers say to each other over one link.

Every message is a tuple whose first item is its kind (a small int: tuples of ints and
bytes pickle in a few microseconds). A call is numbered by the worker that forwards it;
the core answers under the same number.

worker -> core:
    (INFER, call, endpoint, model, version, id, parameters, inputs, outputs, report,
     trace_context)                                      an inference the worker decoded
    (INFERS, calls, endpoint, model, version, ids, parameters, inputs, outputs, report)
                                                         alike INFERs of one write
                                                         (``_coalesce.py``): each input
                                                         with the rows of all, joined
    (HTTP, call, method, path, query, headers, body)     a REST request (body decompressed)
    (GRPC, call, path, metadata, message)                a unary gRPC call
    (GRPC_STREAM, call, path, metadata)                  a streaming call opens
    (MESSAGE, call, message)                             its next request message
    (HALF_CLOSE, call)                                   the client sent its last one
    (CANCEL, call)                                       the client left: withdraw the call
    (FREE, blocks)                                       the core's blocks, read and sent
    (COUNTERS, pull, snapshot)                           the answer to a pull
    (SCRAPE, call)                                       GET /metrics: the families
    (READY,)                                             listening, after CONFIG
core -> worker:
    (CONFIG, settings)                                   first, with the listening sockets
    (ANSWER, [(call, item, last), ...][, returned])      answers to calls (see below),
                                                         those of one turn together;
                                                         ``returned``: the input blocks
                                                         their outputs lie in
    (FREE, blocks)                                       the worker's blocks, done with
    (PULL, pull)                                         a scrape wants the counters
    (DRAIN,)                                             stop accepting, finish, exit

An INFER is answered by one ``(OUTCOME, error, model, version, id, parameters, outputs,
report)``: its tensors as ``(name, datatype, shape, payload, parameters)`` (raw, as the
binary extension and gRPC carry them), ``error`` as ``(kind, message)`` or None,
``report`` the load report asked for (``("http", format)`` or ``("grpc", format)`` in
the INFER: a header, or trailers). The INFERs of an INFERS are answered each so, or
several by one item whose call is the tuple of their calls and whose OUTCOME has the
tuple of their ids and each output's rows of them all, under one's shape (a call
withdrawn meanwhile is ``NO_CALL`` there). An HTTP call is answered by ``(START, status,
headers, compressible, data, more)`` (the head with the first body chunk; a
``compressible`` body comes whole, and the worker compresses it as its client accepts),
then ``(BODY, data, more)`` items while ``more``; a gRPC call by one ``(END, status, message, trailers, reply)`` (a unary call's
reply rides in it; a stream's ``(REPLY, data)`` items come before, and its END's reply
is empty). A SCRAPE is answered by one ``(SCRAPE, families)``: the server's metric
families as its registry collects them (prometheus_client's ``Metric``s), which the
worker renders; None if the server exports none, or collecting them failed (the worker
then forwards the request, which the core answers as one process does).

Bodies and messages (``Payload``) below ``INLINE_BYTES`` travel inside the frame;
larger ones are written once into the sender's ``Arena`` and travel as a ``Block``,
read in place by the peer, which sends the block back in a FREE once it is done. A
frame that uses a segment the peer has not seen yet is wrapped in
``(SEGMENTS, [(segment, size)...], frame)`` carrying the segments' descriptors. An
output that lies in one of its inference's input blocks (a model that answers with its
input, or a slice of it) goes back as ``Returned``, the part of that block it is: the
worker reads it in its own arena, and keeps the block until its answer is sent even
if the core frees it first.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import trio

from .._errors import UnavailableError
from .._limits import GrpcLimits, HttpLimits
from .._tensor import Datatype
from ..ipc import Arena, ArenaFull, Block, SegmentMap, TrioChannel

HTTP, GRPC, GRPC_STREAM, MESSAGE, HALF_CLOSE, CANCEL, FREE, COUNTERS, READY = range(9)
CONFIG, ANSWER, PULL, DRAIN, SEGMENTS, INFER, SCRAPE, INFERS = range(9, 17)
START, BODY, REPLY, END, OUTCOME = range(5)
NO_CALL = 0  # in the calls of an OUTCOME of several: one withdrawn, not answered

INLINE_BYTES = 64 * 1024  # below this a copy into the frame costs less than a block
_ARENA_BYTES = 64 * 1024 * 1024  # the first segment of each side's arena
_ARENA_GROWTH = 64 * 1024 * 1024
ARENA_LABEL = "trioserve-worker-link"  # /proc's name for its segments: /memfd:LABEL


class Returned(NamedTuple):
    """An output that is ``size`` bytes of an input's ``block`` (the worker's), from its
    byte ``offset``."""

    block: Block
    offset: int
    size: int


Payload = bytes | Block
OutputPayload = Payload | Returned  # an OUTCOME's output
_Placed = TypeVar("_Placed")
_Payload = TypeVar("_Payload")


class Carried(Protocol):
    """A tensor as either side holds it (``InputTensor``, ``OutputTensor``)."""

    name: str
    datatype: Datatype
    data: np.ndarray[Any, Any]
    parameters: Mapping[str, Any]


# A tensor as a frame carries it: name, datatype's name, shape, payload, parameters.
WireTensor = tuple[str, str, tuple[int, ...], _Payload, Mapping[str, Any]]


def inline_tensors(tensors: Iterable[Carried]) -> list[WireTensor[Any]] | None:
    """``tensors`` as a frame carries them if each is small and of its datatype already
    (the usual request and answer): their bytes in the frame, as ``array_to_raw`` and
    ``Outbound.pack`` would give them, without their calls (this runs for every request
    on both sides); None if one is not (the general way: blocks, conversions)."""
    carried: list[WireTensor[Any]] = []  # payloads: bytes
    for tensor in tensors:
        data, dt = tensor.data, tensor.datatype
        if dt.is_bytes or data.nbytes >= INLINE_BYTES or data.dtype != dt.dtype:
            return None
        carried.append((tensor.name, dt.name, data.shape, data.tobytes(), tensor.parameters))
    return carried


def address_of(data: bytes | bytearray | memoryview) -> int:
    """Where ``data``'s bytes start in this process's memory."""
    return int(np.frombuffer(data, np.uint8).__array_interface__["data"][0])


def on_loop_when_gone(
    held: object, token: trio.lowlevel.TrioToken, fn: Callable[..., object], *args: Any
) -> None:
    """``fn(*args)`` on the event loop's thread once ``held`` is gone, from whichever
    thread dropped it (the one that let go of an array's last view); nothing once the
    loop ended, nor at the interpreter's exit."""
    weakref.finalize(held, _call_on_loop, token, fn, *args).atexit = False


def _call_on_loop(token: trio.lowlevel.TrioToken, fn: Callable[..., object], *args: Any) -> None:
    with contextlib.suppress(trio.RunFinishedError):
        token.run_sync_soon(fn, *args)


def root_in_place(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """The array every view of ``array`` leads back to, if it reads a buffer in place (a
    payload's memoryview); None if ``array`` is a copy (BYTES are decoded)."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root if isinstance(root.base, memoryview) else None


def lies_in(
    data: bytes | bytearray | memoryview, blocks: Mapping[Block, int]
) -> tuple[Block, int] | None:
    """The block of ``blocks`` (each with the address its bytes start at here) that
    ``data`` lies within, and from which of its bytes; None if none."""
    start = address_of(data)
    for block, block_start in blocks.items():
        offset = start - block_start
        if offset >= 0 and offset + len(data) <= block.size:
            return block, offset
    return None


def new_arena(max_bytes: int | None = None) -> Arena:
    """An arena of at most ``max_bytes`` (None: no bound); a small bound is one segment."""
    if max_bytes is None:
        return Arena(_ARENA_BYTES, _ARENA_GROWTH, label=ARENA_LABEL)
    return Arena(
        min(_ARENA_BYTES, max_bytes), min(_ARENA_GROWTH, max_bytes), max_bytes, ARENA_LABEL
    )


class Outbound:
    """One side's sending half: its channel and the arena its large payloads go into."""

    def __init__(self, channel: TrioChannel, arena: Arena) -> None:
        self.channel = channel
        self.arena = arena

    def pack(self, data: bytes | bytearray | memoryview) -> Payload:
        """``data`` as it travels: in the frame, or copied once into a block. A bounded
        arena that is full refuses it (``UnavailableError``: 503, UNAVAILABLE)."""
        if len(data) < INLINE_BYTES:
            return bytes(data)
        block = self._allocate(len(data))
        self.arena.view(block)[:] = memoryview(data).cast("B")
        return block

    def pack_all(
        self,
        datas: Sequence[bytes | bytearray | memoryview],
        placed: Sequence[_Placed | None] | None = None,
    ) -> list[Payload | _Placed]:
        """Several payloads of one message: all packed, or none (blocks given back);
        where ``placed`` has one for a data already, that one (the caller's to undo)."""
        payloads: list[Payload | _Placed] = []
        try:
            for index, data in enumerate(datas):
                found = None if placed is None else placed[index]
                payloads.append(self.pack(data) if found is None else found)
        except UnavailableError:
            for index, payload in enumerate(payloads):
                if type(payload) is Block and (placed is None or placed[index] is None):
                    self.arena.free(payload)
            raise
        return payloads

    def pack_parts(self, parts: Sequence[bytes | memoryview]) -> Payload:
        """Parts of one message, joined on the way (into the frame or a block)."""
        size = sum(map(len, parts))
        if size < INLINE_BYTES:
            return b"".join(parts)
        block = self._allocate(size)
        view, offset = self.arena.view(block), 0
        for part in parts:
            view[offset : offset + len(part)] = part
            offset += len(part)
        return block

    def _allocate(self, size: int) -> Block:
        try:
            return self.arena.allocate(size)
        except ArenaFull as exc:
            raise UnavailableError(
                f"the server is busy: its front end's shared memory for requests in flight "
                f"is full (--worker-arena-max-bytes); {exc}"
            ) from None

    async def send(self, message: tuple[Any, ...], *payloads: object) -> None:
        """Send ``message``; ``payloads``: those of its items that may be blocks, whose
        segments are announced with it if the peer has not seen them."""
        # The usual message carries its payloads in the frame: no list to make.
        blocks = [p for p in payloads if isinstance(p, Block)] if payloads else None
        fresh = self.arena.unannounced(blocks) if blocks else None
        if not fresh:
            await self.channel.send(message)
            return
        segments = [(segment, size) for segment, _, size in fresh]
        await self.channel.send((SEGMENTS, segments, message), [fd for _, fd, _ in fresh])


def unwrap(message: tuple[Any, ...], fds: list[int], peer: SegmentMap) -> tuple[Any, ...]:
    """The frame inside a SEGMENTS wrapper, its segments mapped; others as they are."""
    if message[0] != SEGMENTS:
        return message
    _, segments, inner = message
    for (segment, size), fd in zip(segments, fds, strict=True):
        peer.add(segment, fd, size)
    return inner  # type: ignore[no-any-return]


def read(payload: Payload, peer: SegmentMap) -> bytes | memoryview:
    """A payload's bytes: the frame's own, or a view of the peer's block (no copy)."""
    return payload if isinstance(payload, bytes) else peer.view(payload)


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker needs to serve (CONFIG), beside its listening sockets, which ride
    with the frame: ``http_sockets`` of them first, then ``metrics_sockets`` (the
    metrics port's), then the gRPC ones."""

    index: int
    host: str
    http_limits: HttpLimits
    grpc_limits: GrpcLimits
    grpc_tls: tuple[str, str] | None  # certificate and key files
    grpc_paths: dict[str, bool]  # the core's gRPC methods: path -> streaming?
    http_sockets: int
    metrics_sockets: int
    exit_timeout_s: float
    arena_max_bytes: int  # its arena's bound (the core's has none)
    log_level: int
