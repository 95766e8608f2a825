"""Arenas: placement, freeing, growth, limits, and what a peer process reads."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.ipc import ALIGNMENT, Arena, ArenaFull, Block, SegmentMap


def test_blocks_do_not_overlap_and_are_aligned() -> None:
    arena = Arena(default_bytes=4096, growth_bytes=4096)
    blocks = [arena.allocate(size) for size in (1, 100, 64, 0, 700)]
    spans = sorted((b.offset, b.offset + max(b.size, 1)) for b in blocks)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert all(b.offset % ALIGNMENT == 0 for b in blocks)
    assert {b.segment for b in blocks} == {0}
    arena.close()


def test_freed_neighbours_merge_back_into_one_range() -> None:
    arena = Arena(default_bytes=4096, growth_bytes=4096)
    blocks = [arena.allocate(1024) for _ in range(4)]
    assert arena.in_use() == 4096
    for block in (blocks[1], blocks[3], blocks[2], blocks[0]):
        arena.free(block)
    assert arena.in_use() == 0
    whole = arena.allocate(4096)  # fits only if every range merged again
    assert whole == Block(0, 0, 4096)
    arena.close()


def test_double_free_is_refused() -> None:
    arena = Arena(default_bytes=4096, growth_bytes=4096)
    block = arena.allocate(128)
    arena.free(block)
    with pytest.raises(ValueError, match="freed twice"):
        arena.free(block)
    arena.close()


def test_grows_by_segments_as_large_as_needed_and_stops_at_its_limit() -> None:
    arena = Arena(default_bytes=4096, growth_bytes=8192, max_bytes=4096 + 8192 + 65536)
    first = arena.allocate(4096)
    second = arena.allocate(100)  # no room left in segment 0: a growth step
    big = arena.allocate(65536)  # larger than a growth step: a segment its own size
    assert (first.segment, second.segment, big.segment) == (0, 1, 2)
    assert arena.mapped_bytes == 4096 + 8192 + 65536
    with pytest.raises(ArenaFull, match="at most"):
        arena.allocate(8192)
    arena.close()


def test_segments_are_announced_once_per_peer() -> None:
    arena = Arena(default_bytes=4096, growth_bytes=4096)
    a, b = arena.allocate(10), arena.allocate(10)
    fresh = arena.unannounced([a, b])
    assert [(segment, size) for segment, _fd, size in fresh] == [(0, 4096)]
    assert arena.unannounced([a]) == []
    arena.forget_peer()
    assert len(arena.unannounced([b])) == 1
    arena.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3000)), max_size=60))
def test_any_sequence_of_allocations_and_frees_keeps_blocks_apart(
    steps: list[tuple[bool, int]],
) -> None:
    arena = Arena(default_bytes=8192, growth_bytes=4096)
    live: dict[Block, int] = {}
    for index, (free, size) in enumerate(steps):
        if free and live:
            block = next(iter(live))
            assert bytes(arena.view(block)) == bytes([live.pop(block)]) * block.size
            arena.free(block)
        else:
            block = arena.write(bytes([index % 256]) * size)
            live[block] = index % 256
    for block, fill in live.items():  # nothing written later overlapped an earlier block
        assert bytes(arena.view(block)) == bytes([fill]) * block.size
        arena.free(block)
    assert arena.in_use() == 0
    arena.close()


def test_a_child_process_reads_and_writes_the_same_memory() -> None:
    arena = Arena(default_bytes=1 << 20, growth_bytes=1 << 20)
    block = arena.write(np.arange(1000, dtype=np.float32).tobytes())
    ((segment, fd, size),) = arena.unannounced([block])
    child = (
        "import os, sys, numpy as np\n"
        "from trioserve.ipc import Block, SegmentMap\n"
        "m = SegmentMap()\n"
        f"m.add({segment}, {fd}, {size})\n"
        f"v = np.frombuffer(m.view(Block({segment}, {block.offset}, {block.size})), np.float32)\n"
        "print(float(v.sum()))\n"
        "v[:] *= 2\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child], pass_fds=[fd], capture_output=True, text=True, check=True
    )
    assert float(done.stdout) == float(np.arange(1000).sum())
    doubled = np.frombuffer(arena.view(block), dtype=np.float32)
    assert np.array_equal(doubled, np.arange(1000, dtype=np.float32) * 2)
    arena.close()


def test_segment_map_refuses_blocks_it_cannot_hold() -> None:
    arena = Arena(default_bytes=4096, growth_bytes=4096)
    block = arena.allocate(16)
    ((segment, fd, size),) = arena.unannounced([block])
    mapped = SegmentMap()
    mapped.add(segment, os.dup(fd), size)
    assert mapped.view(block).nbytes == 16
    with pytest.raises(ValueError, match="outside"):
        mapped.view(Block(segment, 4090, 100))
    with pytest.raises(ValueError, match="never announced"):
        mapped.view(Block(7, 0, 1))
    mapped.close()
    arena.close()


def _named_memory_mapped() -> set[str]:
    """The named shared-memory files this process maps (other processes', such as other
    tests' running alongside, do not count)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if "/dev/shm/" in line}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_segments_have_no_name_to_leak() -> None:
    before = _named_memory_mapped()
    arena = Arena(default_bytes=1 << 16, growth_bytes=1 << 16)
    arena.write(b"x" * 100)
    assert _named_memory_mapped() - before == set()
    arena.close()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="labels show on memory files")
def test_a_segment_shows_its_arenas_label_in_proc() -> None:
    """What tells a worker link's segments from a model process's in a process's
    descriptors (``tools/worker_kills.py`` counts the former)."""
    arena = Arena(default_bytes=1 << 16, growth_bytes=1 << 16, label="trioserve-test-label")
    block = arena.write(b"x" * 100)
    ((_, fd, _),) = arena.unannounced([block])
    assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:trioserve-test-label (deleted)"
    arena.close()
