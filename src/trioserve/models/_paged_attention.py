"""Attention over the engine's paged KV cache, for the built-in models (numpy or cupy).

A layer's cache is two arrays ``(num_blocks, block_size, kv_heads, head_dim)``; a
sequence's position ``p`` lives in ``block_table[p // block_size]`` at slot
``p % block_size``. One step's tokens (every sequence's chunk, concatenated) write their
K/V there, then attend causally over everything their sequence's table holds.

Decode entries (one query each) attend together in one padded pass over their block
tables; prompt chunks attend one by one. Grouped-query attention: query head ``h``
reads K/V head ``h // (heads // kv_heads)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from .._generative import StepSequence

Array = Any  # numpy or cupy ndarray
_Ints = np.ndarray[Any, Any]


@dataclass(frozen=True)
class StepLayout:
    """Where one step's tokens are: in the batch, in their sequences, in the cache."""

    tokens: _Ints  # every entry's token ids, concatenated
    positions: _Ints  # each token's position in its sequence
    slot_blocks: Array  # the cache block each token's K/V go to
    slot_offsets: Array  # and the slot within that block
    offsets: _Ints  # where each entry's tokens start (and, last, the total)
    tables: list[_Ints]  # each entry's block table

    @classmethod
    def of(cls, xp: ModuleType, batch: Sequence[StepSequence], block_size: int) -> StepLayout:
        tokens = np.concatenate([np.asarray(b.token_ids, dtype=np.int64) for b in batch])
        spans = [np.arange(b.start, b.start + len(b.token_ids)) for b in batch]
        tables = [np.asarray(b.block_table, dtype=np.int64) for b in batch]
        positions = np.concatenate(spans)
        blocks = np.concatenate(
            [table[span // block_size] for table, span in zip(tables, spans, strict=True)]
        )
        offsets = np.cumsum([0] + [len(b.token_ids) for b in batch])
        return cls(
            tokens,
            positions,
            xp.asarray(blocks),
            xp.asarray(positions % block_size),
            offsets,
            tables,
        )

    @property
    def last_tokens(self) -> _Ints:
        """The row of each entry's last token (whose logits the engine samples from)."""
        return self.offsets[1:] - 1


class PagedAttention:
    """Causal attention for one model: its cache arrays and the step's layout."""

    def __init__(self, xp: ModuleType, head_dim: int) -> None:
        self.xp = xp
        self.scale = head_dim**-0.5

    def __call__(
        self,
        q: Array,
        k: Array,
        v: Array,
        k_cache: Array,
        v_cache: Array,
        batch: Sequence[StepSequence],
        layout: StepLayout,
    ) -> Array:
        """Write ``k``, ``v`` (tokens, kv_heads, head_dim) into one layer's cache, then
        attend with ``q`` (tokens, heads, head_dim); returns the same shape as ``q``."""
        k_cache[layout.slot_blocks, layout.slot_offsets] = k
        v_cache[layout.slot_blocks, layout.slot_offsets] = v
        xp = self.xp
        out = xp.empty_like(q)
        offsets = layout.offsets
        decodes = [i for i, b in enumerate(batch) if len(b.token_ids) == 1]
        if decodes:
            rows = xp.asarray(offsets[decodes])
            out[rows] = self._decodes(
                q[rows],
                k_cache,
                v_cache,
                [batch[i].start + 1 for i in decodes],
                [layout.tables[i] for i in decodes],
            )
        for i, b in enumerate(batch):
            count = len(b.token_ids)
            if count > 1:
                first = offsets[i]
                out[first : first + count] = self._chunk(
                    q[first : first + count], k_cache, v_cache, b.start, layout.tables[i]
                )
        return out

    def _chunk(self, q: Array, k_cache: Array, v_cache: Array, start: int, table: _Ints) -> Array:
        """A prompt chunk's queries (from position ``start``) over its whole context."""
        xp = self.xp
        count, heads, dim = q.shape
        context = start + count
        blocks = xp.asarray(table)
        kv_heads = k_cache.shape[2]
        keys = k_cache[blocks].reshape(-1, kv_heads, dim)[:context]
        values = v_cache[blocks].reshape(-1, kv_heads, dim)[:context]
        grouped = q.reshape(count, kv_heads, heads // kv_heads, dim)
        scores = xp.einsum("qkgd,tkd->kgqt", grouped, keys) * self.scale
        query_pos = xp.arange(start, context)[:, None]
        scores = xp.where(xp.arange(context)[None, :] <= query_pos, scores, -xp.inf)
        out = xp.einsum("kgqt,tkd->qkgd", _softmax(xp, scores), values)
        return out.reshape(count, heads, dim)

    def _decodes(
        self,
        q: Array,
        k_cache: Array,
        v_cache: Array,
        lengths: list[int],
        tables: list[_Ints],
    ) -> Array:
        """One query per sequence: all sequences at once over a padded block table."""
        xp = self.xp
        rows, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        width = max(len(t) for t in tables)
        padded = np.zeros((rows, width), dtype=np.int64)
        for row, table in enumerate(tables):
            padded[row, : len(table)] = table
        padded = xp.asarray(padded)
        # (b, kv, t, d): batched matmul is much faster than einsum here.
        keys = k_cache[padded].reshape(rows, -1, kv_heads, dim).transpose(0, 2, 1, 3)
        values = v_cache[padded].reshape(rows, -1, kv_heads, dim).transpose(0, 2, 1, 3)
        grouped = q.reshape(rows, kv_heads, heads // kv_heads, dim)  # (b, kv, g, d)
        scores = xp.matmul(grouped, keys.transpose(0, 1, 3, 2)) * self.scale  # (b, kv, g, t)
        valid = xp.asarray(np.arange(keys.shape[2])[None, :] < np.array(lengths)[:, None])
        scores = xp.where(valid[:, None, None, :], scores, -xp.inf)
        return xp.matmul(_softmax(xp, scores), values).reshape(rows, heads, dim)


def _softmax(xp: ModuleType, scores: Array) -> Array:
    e = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
