"""Shared memory that one process writes and its peer reads: segments and their blocks.

A segment is an anonymous memory file (``memfd_create`` where the platform has it, an
unlinked temporary file elsewhere), mapped by both processes. It has no name, so
nothing is left behind in ``/dev/shm`` whichever process dies: the kernel frees it with
the last descriptor. Its descriptor reaches the peer inside the frame that first uses
it (``SCM_RIGHTS``, see ``_frames``).

An ``Arena`` is the writer's side: it places blocks in its segments (first fit, 64-byte
aligned, neighbours merged on free) and grows by a new segment when none has room, as
Triton's Python backend grows its region by ``shm-growth-byte-size`` steps. The peer
maps the segments it is told of in a ``SegmentMap`` and reads a block as a memoryview,
without a copy. Who frees a block, and when, is the protocol's business: the writer
frees it once the peer says it is done with it.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import tempfile
import threading
from typing import NamedTuple

ALIGNMENT = 64


class ArenaFull(MemoryError):
    """No room for a block, and the arena may not grow by enough for it."""


class Block(NamedTuple):
    """Where a block lies: which segment, from which byte, how many bytes. A tuple: it
    crosses links in frames, and a tuple pickles several times faster than a class."""

    segment: int
    offset: int
    size: int


def anonymous_memory(size: int, label: str = "trioserve-ipc") -> int:
    """A new descriptor of ``size`` bytes of memory that has no name in any file system;
    ``label`` is what /proc shows for it (``/memfd:LABEL``), to tell whose it is."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
    else:  # macOS: an unlinked file; the page cache backs it all the same
        fd, path = tempfile.mkstemp(prefix=f"{label}-")
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


class _Segment:
    """One mapped memory file, with its free ranges as sorted (offset, size) lists."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.memory = mmap.mmap(fd, size)
        self.free_offsets = [0]
        self.free_sizes = [size]

    def take(self, size: int) -> int | None:
        for index, free in enumerate(self.free_sizes):
            if free >= size:
                offset = self.free_offsets[index]
                if free == size:
                    del self.free_offsets[index], self.free_sizes[index]
                else:
                    self.free_offsets[index] = offset + size
                    self.free_sizes[index] = free - size
                return offset
        return None

    def give_back(self, offset: int, size: int) -> None:
        index = bisect.bisect(self.free_offsets, offset)
        offsets, sizes = self.free_offsets, self.free_sizes
        if index and offsets[index - 1] + sizes[index - 1] > offset:
            raise ValueError(f"block at {offset} freed twice")
        if index < len(offsets) and offset + size > offsets[index]:
            raise ValueError(f"block at {offset} freed twice")
        if index < len(offsets) and offset + size == offsets[index]:  # merge with the next
            size += sizes[index]
            del offsets[index], sizes[index]
        if index and offsets[index - 1] + sizes[index - 1] == offset:  # and the previous
            sizes[index - 1] += size
        else:
            offsets.insert(index, offset)
            sizes.insert(index, size)

    @property
    def unused(self) -> bool:
        return self.free_sizes == [self.size]

    def close(self) -> None:
        _unmap(self.memory)
        os.close(self.fd)


class Arena:
    """The writer's segments. Thread-safe: model threads and the event loop share one.
    ``label``: its segments' (``anonymous_memory``), to tell whose they are in /proc."""

    def __init__(
        self,
        default_bytes: int,
        growth_bytes: int,
        max_bytes: int | None = None,
        label: str = "trioserve-ipc",
    ) -> None:
        if default_bytes <= 0 or growth_bytes <= 0:
            raise ValueError("an arena's default and growth sizes must be positive")
        self._label = label
        self._default = default_bytes
        self._growth = growth_bytes
        self._max = max_bytes
        self._segments: dict[int, _Segment] = {}
        self._announced: set[int] = set()
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def mapped_bytes(self) -> int:
        return sum(s.size for s in self._segments.values())

    def allocate(self, size: int) -> Block:
        """A block of at least ``size`` bytes (0 is allowed), growing the arena if needed."""
        rounded = max(ALIGNMENT, -(-size // ALIGNMENT) * ALIGNMENT)
        with self._lock:
            for number, segment in self._segments.items():
                offset = segment.take(rounded)
                if offset is not None:
                    return Block(number, offset, size)
            segment_size = self._default if not self._segments else self._growth
            segment_size = max(segment_size, -(-rounded // mmap.PAGESIZE) * mmap.PAGESIZE)
            if self._max is not None and self.mapped_bytes + segment_size > self._max:
                raise ArenaFull(
                    f"{size} bytes do not fit: the arena holds {self.mapped_bytes} of at most "
                    f"{self._max} bytes"
                )
            number = self._next_id
            self._next_id += 1
            self._segments[number] = segment = _Segment(
                anonymous_memory(segment_size, self._label), segment_size
            )
            offset = segment.take(rounded)
            assert offset == 0
            return Block(number, 0, size)

    def write(self, data: bytes | bytearray | memoryview) -> Block:
        """Copy ``data`` into a new block."""
        source = memoryview(data).cast("B")
        block = self.allocate(source.nbytes)
        self.view(block)[:] = source
        return block

    def view(self, block: Block) -> memoryview:
        """The block's bytes, writable."""
        segment = self._segments[block.segment]
        return memoryview(segment.memory)[block.offset : block.offset + block.size]

    def free(self, block: Block) -> None:
        rounded = max(ALIGNMENT, -(-block.size // ALIGNMENT) * ALIGNMENT)
        with self._lock:
            self._segments[block.segment].give_back(block.offset, rounded)

    def unannounced(self, blocks: list[Block]) -> list[tuple[int, int, int]]:
        """(segment, descriptor, size) of each segment of ``blocks`` the peer has not been
        sent yet; marks them sent. The caller queues the frame with the descriptors in the
        same step (no checkpoint between), so that no frame using a segment can overtake
        the one announcing it."""
        fresh = []
        with self._lock:
            for block in blocks:
                if block.segment not in self._announced:
                    self._announced.add(block.segment)
                    segment = self._segments[block.segment]
                    fresh.append((block.segment, segment.fd, segment.size))
        return fresh

    def forget_peer(self) -> None:
        """A new peer (a restarted process) has seen none of the segments."""
        with self._lock:
            self._announced.clear()

    def in_use(self) -> int:
        """Bytes held by blocks not yet freed (rounded to the alignment)."""
        with self._lock:
            return sum(s.size - sum(s.free_sizes) for s in self._segments.values())

    def close(self) -> None:
        with self._lock:
            for segment in self._segments.values():
                segment.close()
            self._segments.clear()


class SegmentMap:
    """The reader's side: the peer's segments, mapped as their descriptors arrive."""

    def __init__(self) -> None:
        self._segments: dict[int, mmap.mmap] = {}

    def add(self, segment: int, fd: int, size: int) -> None:
        """Map a segment the peer announced; the descriptor is closed (the mapping stays)."""
        try:
            old = self._segments.pop(segment, None)
            if old is not None:
                _unmap(old)
            self._segments[segment] = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def view(self, block: Block) -> memoryview:
        try:
            memory = self._segments[block.segment]
        except KeyError:
            raise ValueError(f"segment {block.segment} was never announced") from None
        if block.offset < 0 or block.offset + block.size > len(memory):
            raise ValueError(f"block {block} lies outside its segment")
        return memoryview(memory)[block.offset : block.offset + block.size]

    def close(self) -> None:
        for memory in self._segments.values():
            _unmap(memory)
        self._segments.clear()


def _unmap(memory: mmap.mmap) -> None:
    # A view still alive (a numpy array reading it) keeps the mapping until it goes.
    with contextlib.suppress(BufferError):
        memory.close()
