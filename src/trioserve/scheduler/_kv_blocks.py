"""The paged KV cache's bookkeeping: which block holds what, who uses it, what is cached.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A block in use has a
reference count (the sequences whose block tables hold it: samples of one request
share their prompt's blocks). With prefix caching on, a block that fills up is named by
a hash chained over its parent block's hash and its own token ids, so one hash names a
whole prefix; a new sequence reuses the longest run of cached blocks its tokens name.

A block whose last user lets go stays cached (its K/V are still valid) but becomes
free: it is handed out again only when no never-cached block is free, least recently
freed first, and then it loses its hash (evicted).

Pure bookkeeping: no trio, no arrays; the model owns the memory the block ids index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_NO_PARENT = 0  # the parent hash of a sequence's first block


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The name of a full block given its parent's name and its tokens (chained)."""
    return hash((parent, *token_ids))


def chain_hashes(
    token_ids: Sequence[int], block_size: int, start_block: int = 0, parent: int = _NO_PARENT
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on."""
    hashes = []
    for first in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[first : first + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks a sequence can start from, and the hashes of its full blocks."""

    blocks: list[int]
    hashes: list[int]  # of every full block of the queried tokens (the first len(blocks) hit)


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block
        # Free blocks, next to hand out first: never-cached ones at the front, cached
        # ones behind them in the order they were freed (LRU eviction).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (cached but unused blocks count as free)."""
        return self.num_used / self.num_blocks

    def blocks_needed(self, num_tokens: int, blocks_held: int) -> int:
        """Blocks to add so that a table of ``blocks_held`` blocks covers ``num_tokens``."""
        return max(0, -(-num_tokens // self.block_size) - blocks_held)

    def lookup(self, token_ids: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of ``token_ids``, leaving at least the last token.

        The last token is never taken from the cache: the step that processes it gives
        the logits the next token is sampled from.
        """
        hashes = chain_hashes(token_ids, self.block_size) if self.prefix_caching else []
        usable = (len(token_ids) - 1) // self.block_size
        blocks = []
        for h in hashes[:usable]:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return PrefixHit(blocks, hashes)

    def can_allocate(self, count: int, reusing: Sequence[int] = ()) -> bool:
        """Whether ``count`` new blocks are free once ``reusing`` (cached blocks) are taken."""
        if not reusing:
            return count <= len(self._free)
        taken_from_free = sum(1 for b in reusing if self._refs[b] == 0)
        return count + taken_from_free <= len(self._free)

    def share(self, blocks: Sequence[int]) -> None:
        """Add a user to each of ``blocks`` (cached prefix blocks, or a sibling's blocks)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks with one user each (evicting cached ones if needed)."""
        if count > len(self._free):
            raise RuntimeError(f"{count} blocks asked for, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of[block]
            if old is not None:
                del self._cached[old]
                self._hash_of[block] = None
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one user of each block; blocks left unused become free (still cached)."""
        # Reversed: a sequence's tail blocks are the least likely to be shared again,
        # so they are freed (and so evicted) before its head blocks.
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._hash_of[block] is None:
                    self._free.move_to_end(block, last=False)

    def register(self, block: int, h: int) -> None:
        """Name a block that just filled up, unless another block already has that name."""
        if self.prefix_caching and h not in self._cached and self._hash_of[block] is None:
            self._cached[h] = block
            self._hash_of[block] = h

    def ref_count(self, block: int) -> int:
        return self._refs[block]
