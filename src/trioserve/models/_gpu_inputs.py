"""One engine step's inputs for the GPU forward, packed on the host (numpy only).

Every integer the kernels read (token ids, positions, cache slots, each token's row of
the block tables, each entry's last token, the block tables themselves) goes in one
int32 array, so that a step costs one host-to-device copy. Its layout, for ``rows``
tokens, ``entries`` sequences and tables ``width`` blocks wide::

    tokens[rows] | positions[rows] | slots[rows] | token_rows[rows] | last_rows[entries]
    | block_tables[entries * width]

A decode step (one token per sequence) is padded to its bucket, the batch size of a
captured CUDA graph: padding rows read token 0 at position 0 through an all-zero table
row and have slot -1, which the cache write skips, so they touch no sequence's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._generative import StepSequence

Ints = np.ndarray[Any, Any]
FIELDS = ("tokens", "positions", "slots", "token_rows")  # one int per row each


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes a decode graph is captured for: powers of two up to
    ``max_num_seqs``, and ``max_num_seqs`` itself."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    sizes.append(max_num_seqs)
    return tuple(sizes)


def bucket_for(entries: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``entries`` sequences (None: larger than all)."""
    for size in buckets:
        if size >= entries:
            return size
    return None


def is_decode(batch: Sequence[StepSequence]) -> bool:
    return all(len(entry.token_ids) == 1 for entry in batch)


@dataclass(frozen=True)
class PackedStep:
    """A step's integers in one array, and where each part of it lies."""

    ints: Ints
    rows: int
    entries: int
    width: int

    def part(self, name: str) -> Ints:
        """One of FIELDS, ``last_rows`` or ``block_tables`` (entries x width): a view."""
        view: Ints = part(self.ints, name, self.rows, self.entries, self.width)
        return view


def part(ints: Any, name: str, rows: int, entries: int, width: int) -> Any:
    """A view of one part of a packed array (numpy or cupy alike)."""
    if name in FIELDS:
        start = FIELDS.index(name) * rows
        return ints[start : start + rows]
    last = len(FIELDS) * rows
    if name == "last_rows":
        return ints[last : last + entries]
    if name == "block_tables":
        return ints[last + entries : last + entries + entries * width].reshape(entries, width)
    raise KeyError(name)


def packed_size(rows: int, entries: int, width: int) -> int:
    return len(FIELDS) * rows + entries + entries * width


def pack_step(
    batch: Sequence[StepSequence],
    block_size: int,
    *,
    pad_to: int | None = None,
    width: int | None = None,
) -> PackedStep:
    """``batch`` packed; ``pad_to`` (decode steps only) pads it to that many entries,
    ``width`` fixes the tables' width (a captured graph's), else the longest table's."""
    lengths = [len(entry.token_ids) for entry in batch]
    entries = len(batch)
    rows = sum(lengths)
    if pad_to is not None:
        if rows != entries or pad_to < entries:
            raise ValueError("only a decode step fits a padded bucket")
        entries = rows = pad_to
    longest = max(len(entry.block_table) for entry in batch)
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"a block table of {longest} blocks exceeds the width {width}")
    packed = PackedStep(np.zeros(packed_size(rows, entries, width), np.int32), rows, entries, width)
    tables = packed.part("block_tables")
    positions = np.concatenate(
        [
            np.arange(e.start, e.start + n, dtype=np.int64)
            for e, n in zip(batch, lengths, strict=True)
        ]
    )
    real = len(positions)
    packed.part("tokens")[:real] = np.concatenate([np.asarray(e.token_ids) for e in batch])
    packed.part("positions")[:real] = positions
    token_rows = np.repeat(np.arange(len(batch)), lengths)
    packed.part("token_rows")[:real] = token_rows
    packed.part("token_rows")[real:] = np.arange(len(batch), entries)  # padding's own rows
    for row, entry in enumerate(batch):
        tables[row, : len(entry.block_table)] = entry.block_table
    slots = packed.part("slots")
    slots[:real] = tables[token_rows, positions // block_size] * block_size + positions % block_size
    slots[real:] = -1
    packed.part("last_rows")[: len(batch)] = np.cumsum(lengths) - 1
    packed.part("last_rows")[len(batch) :] = np.arange(real, rows)
    return packed
