"""BlockPool bookkeeping: ref counts, free-queue (eviction) order, the prefix-cache hash map."""

import pytest

from pagoda.scheduling.block_pool import BlockPool, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    """Block ids in the free queue, head (evicted first) to tail."""
    return [b.block_id for b in pool.free_queue.values()]


def ref_cnts(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def h(i: int) -> bytes:
    return hash_block_tokens(None, [i, i, i, i])


def test_initial_state():
    pool = BlockPool(5)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3, 4]
    assert ref_cnts(pool) == [0, 0, 0, 0, 0]
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.cached == {}
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0


def test_needs_at_least_one_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_get_new_blocks_pops_from_head():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert ref_cnts(pool) == [1, 1, 0, 0, 0]
    assert free_ids(pool) == [2, 3, 4]
    assert pool.usage == pytest.approx(0.4)

    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [2, 3, 4]
    assert free_ids(pool) == []
    assert pool.usage == 1.0


def test_get_new_blocks_too_many_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [1, 2]
    assert ref_cnts(pool) == [1, 0, 0]


def test_get_zero_blocks():
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    assert free_ids(pool) == [0, 1]


def test_free_appends_to_tail_in_given_order():
    pool = BlockPool(5)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.free_blocks([b2, b0])
    assert free_ids(pool) == [3, 4, 2, 0]
    assert ref_cnts(pool) == [0, 1, 0, 0, 0]
    pool.free_blocks([b1])
    assert free_ids(pool) == [3, 4, 2, 0, 1]
    # LRU: blocks freed earlier are reused first.
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 4, 2, 0]
    assert free_ids(pool) == [1]


def test_shared_block_joins_queue_only_at_zero_refs():
    pool = BlockPool(3)
    (b0,) = pool.get_new_blocks(1)
    pool.touch([b0])
    assert b0.ref_cnt == 2
    pool.free_blocks([b0])
    assert b0.ref_cnt == 1
    assert free_ids(pool) == [1, 2]
    pool.free_blocks([b0])
    assert b0.ref_cnt == 0
    assert free_ids(pool) == [1, 2, 0]


def test_double_free_is_caught():
    pool = BlockPool(2)
    (b0,) = pool.get_new_blocks(1)
    pool.free_blocks([b0])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b0])
    assert free_ids(pool) == [1, 0]


def test_touch_pulls_free_cached_block_out_of_queue():
    pool = BlockPool(5)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.cache_full_block(b1, h(1))
    pool.free_blocks([b2, b1, b0])
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    assert ref_cnts(pool) == [0, 0, 0, 0, 0]

    hit = pool.get_cached_block(h(1))
    assert hit is b1
    pool.touch([hit])
    assert b1.ref_cnt == 1
    assert free_ids(pool) == [3, 4, 2, 0]
    assert b1.block_hash == h(1)
    assert pool.cached == {h(1): b1}

    # A second reference (another request's hit) leaves the queue alone.
    pool.touch([hit])
    assert b1.ref_cnt == 2
    assert free_ids(pool) == [3, 4, 2, 0]
    assert pool.get_cached_block(h(2)) is None


def test_eviction_of_cached_block_removes_its_hash():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_full_block(b, h(i))
    pool.free_blocks(blocks)
    assert free_ids(pool) == [0, 1, 2]
    assert pool.cached == {h(0): blocks[0], h(1): blocks[1], h(2): blocks[2]}
    # Cached free blocks count as free.
    assert pool.usage == 0.0

    (new,) = pool.get_new_blocks(1)
    assert new is blocks[0]
    assert new.block_hash is None
    assert new.ref_cnt == 1
    assert pool.cached == {h(1): blocks[1], h(2): blocks[2]}
    assert pool.get_cached_block(h(0)) is None
    assert free_ids(pool) == [1, 2]


def test_first_cached_block_wins_for_a_duplicate_hash():
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_block(b0, h(7))
    pool.cache_full_block(b1, h(7))
    assert b0.block_hash == h(7)
    assert b1.block_hash is None
    assert pool.cached == {h(7): b0}

    # A cached block is immutable: caching it again under another hash is a no-op.
    pool.cache_full_block(b0, h(8))
    assert b0.block_hash == h(7)
    assert pool.cached == {h(7): b0}

    # Evicting the uncached duplicate does not touch the winner's entry.
    pool.free_blocks([b1, b0])
    assert free_ids(pool) == [2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert pool.cached == {h(7): b0}
    assert pool.get_cached_block(h(7)) is b0


def test_caching_disabled():
    pool = BlockPool(2, enable_caching=False)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_full_block(b0, h(0))
    assert b0.block_hash is None
    assert pool.cached == {}
    assert pool.get_cached_block(h(0)) is None


def test_reset_prefix_cache():
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_block(b0, h(0))
    pool.cache_full_block(b1, h(1))
    pool.free_blocks([b1])
    # A request still holds b0: refused, nothing forgotten.
    assert pool.reset_prefix_cache() is False
    assert pool.cached == {h(0): b0, h(1): b1}
    assert b1.block_hash == h(1)

    pool.free_blocks([b0])
    assert free_ids(pool) == [2, 1, 0]
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.block_hash is None for b in pool.blocks)
    assert free_ids(pool) == [2, 1, 0]
    assert ref_cnts(pool) == [0, 0, 0]


def test_hash_is_deterministic():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, (1, 2, 3, 4))
    assert isinstance(a, bytes) and len(a) == 32
    assert hash_block_tokens(a, [5, 6], "salt") == hash_block_tokens(a, [5, 6], "salt")


def test_hash_covers_tokens_and_their_order():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert a != hash_block_tokens(None, [4, 3, 2, 1])
    assert a != hash_block_tokens(None, [1, 2, 3])
    # Token ids are 64-bit: large ids do not collide with small ones.
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


def test_hash_chain_same_tokens_different_parent():
    p1 = hash_block_tokens(None, [1, 2, 3, 4])
    p2 = hash_block_tokens(None, [9, 2, 3, 4])
    assert hash_block_tokens(p1, [5, 6, 7, 8]) != hash_block_tokens(p2, [5, 6, 7, 8])
    assert hash_block_tokens(p1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])


def test_extra_key_changes_hash():
    plain = hash_block_tokens(None, [1, 2, 3, 4])
    salted = hash_block_tokens(None, [1, 2, 3, 4], "user-a")
    assert salted != plain
    assert salted != hash_block_tokens(None, [1, 2, 3, 4], "user-b")
    assert hash_block_tokens(None, [1, 2, 3, 4], "") != plain
    # The salt propagates down the chain through the parent hash.
    assert hash_block_tokens(salted, [5, 6, 7, 8]) != hash_block_tokens(plain, [5, 6, 7, 8])
