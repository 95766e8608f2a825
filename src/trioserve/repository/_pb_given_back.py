"""The blocks of an instance process's arena the server is done with, on their way back.

An output the server read in place (``_pb_process``) lets go of its block when the last
array viewing it goes: from any thread (a finalizer). The block goes back with the next
``exec`` frame (``take``), or in a ``free`` frame of its own once enough waits (a byte
or a block count, ``flush_soon`` called), so that small outputs cost no frame of their
own and big ones no memory for long. Blocks belong to one process: when it dies, those
waiting are dropped and any let go of later (an answer still being sent) are refused
(``next_process``), or the next process would free memory it never gave out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..ipc import Block

FLUSH_BLOCKS = 64  # blocks given back in a frame of their own, at most


class GivenBack:
    def __init__(self, flush_bytes: int, flush_soon: Callable[[], None]) -> None:
        self._flush_bytes = flush_bytes
        self._flush_soon = flush_soon  # from any thread: schedule a ``take`` and a frame
        self._blocks: list[Block] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self.generation = 0  # which process; a block's lease carries the one it came from

    def give_back(self, block: Block, generation: int) -> None:
        with self._lock:
            if generation != self.generation:
                return
            self._blocks.append(block)
            self._bytes += block.size
            flush = self._bytes >= self._flush_bytes or len(self._blocks) >= FLUSH_BLOCKS
            if flush:
                self._bytes = -(2**62)  # one flush scheduled at a time
        if flush:
            self._flush_soon()

    def take(self) -> list[Block]:
        """The blocks waiting, for a frame."""
        with self._lock:
            blocks, self._blocks = self._blocks, []
            self._bytes = 0
        return blocks

    def next_process(self) -> None:
        """The process died: its arena went with it."""
        with self._lock:
            self.generation += 1
            self._blocks.clear()
            self._bytes = 0
