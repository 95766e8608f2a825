"""The blocks of a front-end worker's arena that hold inference inputs, and who holds
them.

A large binary inference request is received from the socket into a block of the
worker's arena (``rest.ReceivesInto``), and each large input it holds goes to the core
as the part of that block it lies in: the tensor's bytes are written once, by the
kernel, where the core reads them. Such a body's block is freed once the request is
done with it (the body's memoryview is collected) and the core has freed every part of
it that it was sent.

An output that lies in an input's block (``Returned``) is read by the worker in place:
that input is kept until the answer has been sent, even if the core frees it first.
"""

from __future__ import annotations

import trio

from ..ipc import Arena, ArenaFull, Block
from ._wire import address_of, lies_in, on_loop_when_gone


class InputBlocks:
    """The bodies received into ``arena``, the parts of them the core holds, and the
    inputs that answers read."""

    def __init__(self, arena: Arena) -> None:
        self._arena = arena
        self._starts: dict[Block, int] = {}  # each body's block -> its address here
        self._holds: dict[Block, int] = {}  # each body's block -> what holds it
        self._parts: dict[Block, Block] = {}  # each part the core holds -> its body's
        self._read: dict[Block, int] = {}  # each input an answer reads -> how many do
        self._freed: set[Block] = set()  # of those, the ones the core is done with
        self._token = trio.lowlevel.current_trio_token()

    @property
    def receiving(self) -> bool:
        """Whether any body lies in the arena now."""
        return bool(self._starts)

    def buffer(self, length: int) -> memoryview | None:
        """A writable buffer of ``length`` bytes for a body, in a new block; None if the
        arena is full (the body then goes into a bytearray, and its tensors are
        copied into the arena, or refused, as a JSON body's are)."""
        try:
            block = self._arena.allocate(length)
        except ArenaFull:
            return None
        view = self._arena.view(block)
        self._starts[block] = address_of(view)
        self._holds[block] = 1  # the request's
        # Run where the body's last view is dropped, which may be a worker thread (one
        # decoding a large request): the event loop's thread lets go of it.
        on_loop_when_gone(view, self._token, self._let_go, block)
        return view

    def part(self, data: bytes | bytearray | memoryview) -> Block | None:
        """``data`` as the part of a body's block it is, held until the core frees it;
        None if it lies in no body received here."""
        found = lies_in(data, self._starts)
        if found is None:
            return None
        block, offset = found
        part = Block(block.segment, block.offset + offset, len(data))
        self._parts[part] = block
        self._holds[block] += 1
        return part

    def read_by_answer(self, block: Block) -> None:
        """An answer's output lies in the input ``block``: kept until ``answer_done``."""
        self._read[block] = self._read.get(block, 0) + 1

    def answer_done(self, block: Block) -> None:
        """An answer that read the input ``block`` has been sent (or dropped)."""
        readers = self._read[block] - 1
        if readers:
            self._read[block] = readers
            return
        del self._read[block]
        if block in self._freed:
            self._freed.remove(block)
            self._release(block)

    def free(self, block: Block) -> None:
        """The core is done with ``block`` (a FREE): an input, a part of a body, or a
        block of the arena's own."""
        if block in self._read:
            self._freed.add(block)  # an answer still reads it
        else:
            self._release(block)

    def _release(self, block: Block) -> None:
        body = self._parts.pop(block, None)
        if body is None:
            self._arena.free(block)
        else:
            self._let_go(body)

    def _let_go(self, block: Block) -> None:
        holds = self._holds[block] - 1
        if holds:
            self._holds[block] = holds
            return
        del self._holds[block], self._starts[block]
        self._arena.free(block)
