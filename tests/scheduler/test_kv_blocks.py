"""The KV block manager: allocation, sharing, prefix hashing, LRU eviction of cached blocks."""

import pytest

from trioserve.scheduler._kv_blocks import KVBlockManager, block_hash, chain_hashes


def test_allocate_and_free_track_usage():
    blocks = KVBlockManager(4, 16)
    first = blocks.allocate(3)
    assert len(set(first)) == 3 and blocks.num_used == 3 and blocks.usage == 0.75
    assert not blocks.can_allocate(2) and blocks.can_allocate(1)
    with pytest.raises(RuntimeError, match="2 blocks asked for, 1 free"):
        blocks.allocate(2)
    blocks.free(first)
    assert blocks.num_used == 0 and blocks.usage == 0.0


def test_blocks_needed_rounds_up_to_whole_blocks():
    blocks = KVBlockManager(8, 16)
    assert blocks.blocks_needed(1, 0) == 1
    assert blocks.blocks_needed(16, 0) == 1
    assert blocks.blocks_needed(17, 1) == 1
    assert blocks.blocks_needed(32, 2) == 0


def test_shared_blocks_stay_used_until_the_last_user_frees_them():
    blocks = KVBlockManager(4, 16)
    held = blocks.allocate(2)
    blocks.share(held)
    assert [blocks.ref_count(b) for b in held] == [2, 2]
    blocks.free(held)
    assert blocks.num_used == 2
    blocks.free(held)
    assert blocks.num_used == 0


def test_hashes_chain_over_the_parent():
    tokens = list(range(40))
    hashes = chain_hashes(tokens, 16)
    assert len(hashes) == 2  # the last 8 tokens do not fill a block
    assert hashes[0] == block_hash(0, tokens[:16])
    assert hashes[1] == block_hash(hashes[0], tokens[16:32])
    # The same block of tokens after a different prefix is a different block.
    assert chain_hashes(list(range(100, 116)) + tokens[16:32], 16)[1] != hashes[1]


def _computed(blocks: KVBlockManager, tokens: list[int]) -> list[int]:
    """Allocate blocks for ``tokens`` and register the full ones, as the engine does."""
    held = blocks.allocate(blocks.blocks_needed(len(tokens), 0))
    for block, h in zip(held, chain_hashes(tokens, blocks.block_size), strict=False):
        blocks.register(block, h)
    return held


def test_lookup_finds_the_longest_cached_prefix_but_never_the_last_token():
    blocks = KVBlockManager(8, 4)
    tokens = list(range(12))
    held = _computed(blocks, tokens)
    hit = blocks.lookup(tokens)
    assert hit.blocks == held[:2]  # 3 full blocks cached; the last token must be computed
    assert blocks.lookup(list(range(13))).blocks == held  # one more token: all 3 reusable
    assert blocks.lookup([0, 1, 2, 3, 9, 9, 9, 9, 9]).blocks == held[:1]
    assert blocks.lookup([7, 7, 7, 7, 7]).blocks == []


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    blocks = KVBlockManager(4, 4)
    a = _computed(blocks, [1] * 4)
    b = _computed(blocks, [2] * 4)
    blocks.free(a)
    blocks.free(b)
    assert blocks.num_used == 0
    assert blocks.lookup([1] * 5).blocks == a and blocks.lookup([2] * 5).blocks == b
    # Never-cached blocks go first; then the least recently freed cached block (a).
    fresh = blocks.allocate(2)
    assert set(fresh).isdisjoint(a + b)
    assert blocks.allocate(1) == a
    assert blocks.lookup([1] * 5).blocks == []
    assert blocks.lookup([2] * 5).blocks == b


def test_reusing_a_cached_block_takes_it_off_the_free_list():
    blocks = KVBlockManager(2, 4)
    cached = _computed(blocks, [5] * 4)
    blocks.free(cached)
    assert blocks.can_allocate(2) and not blocks.can_allocate(2, reusing=cached)
    blocks.share(cached)
    assert blocks.num_used == 1 and blocks.allocate(1) != cached


def test_a_second_block_with_a_known_hash_is_not_registered():
    blocks = KVBlockManager(4, 4)
    first = _computed(blocks, [3] * 4)
    second = _computed(blocks, [3] * 4)
    blocks.free(first)
    blocks.free(second)
    assert blocks.lookup([3] * 5).blocks == first


def test_prefix_caching_off_finds_nothing():
    blocks = KVBlockManager(4, 4, prefix_caching=False)
    _computed(blocks, [1] * 8)
    assert blocks.lookup([1] * 9).blocks == []
