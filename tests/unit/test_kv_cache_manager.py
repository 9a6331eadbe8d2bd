"""KVCacheManager: allocation over the block pool, prefix lookup, fork and copy-on-write.

The manager is driven by hand the way the scheduler drives it: look up hits, allocate slots,
advance num_computed_tokens, publish full blocks, free.
"""

import pytest

from pagoda.sampling_params import SamplingParams
from pagoda.scheduling.block_pool import BlockPool, hash_block_tokens
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.request import Request, RequestStatus

BS = 4


def make_manager(num_blocks: int, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, enable_caching), BS)


def make_request(
    rid: str,
    prompt: list[int],
    *,
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
) -> Request:
    params = SamplingParams(max_tokens=16, prompt_logprobs=prompt_logprobs)
    return Request(
        rid,
        list(prompt),
        params,
        max_tokens=16,
        eos_token_ids=frozenset({0}),
        arrival_time=0.0,
        cache_salt=cache_salt,
    )


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.pool.free_queue.values()]


def ref_cnts(m: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in m.pool.blocks]


def cached_ids(m: KVCacheManager) -> list[int]:
    return sorted(b.block_id for b in m.pool.cached.values())


def prefill(m: KVCacheManager, req: Request) -> int:
    """Schedule the whole prompt in one step (as the scheduler does); returns the hit tokens."""
    hits, num_hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - num_hit, hits)
    req.num_computed_tokens = req.num_tokens
    m.cache_blocks(req)
    return num_hit


def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    for j in range(len(tokens) // BS):
        parent = hashes[-1] if hashes else None
        hashes.append(
            hash_block_tokens(parent, tokens[j * BS : (j + 1) * BS], salt if j == 0 else None)
        )
    return hashes


PROMPT = list(range(100, 112))  # 12 tokens: three full blocks


# ---- allocate_slots ---------------------------------------------------------------------


def test_allocate_slots_block_counts_across_boundaries():
    m = make_manager(10)
    req = make_request("a", list(range(100, 120)))
    # (num_computed_tokens, num_new_tokens) -> block ids afterwards
    steps = [
        (0, 3, [0]),  # positions 0..2
        (3, 1, [0]),  # position 3 fills block 0
        (4, 1, [0, 1]),  # position 4 opens block 1
        (5, 8, [0, 1, 2, 3]),  # positions 5..12 span blocks 1..3
        (13, 0, [0, 1, 2, 3]),
        (13, 3, [0, 1, 2, 3]),  # positions 13..15: block 3 exactly full
        (16, 4, [0, 1, 2, 3, 4]),  # positions 16..19
    ]
    for num_computed, num_new, expected in steps:
        req.num_computed_tokens = num_computed
        assert m.allocate_slots(req, num_new)
        assert m.get_block_ids("a") == expected
    assert ref_cnts(m) == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert free_ids(m) == [5, 6, 7, 8, 9]
    assert m.take_pending_copies() == []


def test_allocate_slots_fails_without_side_effects():
    m = make_manager(3)
    a = make_request("a", list(range(100, 108)))
    assert m.allocate_slots(a, 8)
    assert m.get_block_ids("a") == [0, 1]

    b = make_request("b", list(range(200, 205)))
    assert not m.allocate_slots(b, 5)  # needs 2 blocks, 1 free
    assert m.get_block_ids("b") == []
    assert free_ids(m) == [2]
    assert ref_cnts(m) == [1, 1, 0]

    assert m.allocate_slots(b, 4)
    assert m.get_block_ids("b") == [2]


def test_allocate_slots_counts_free_prefix_hits_against_the_pool():
    m = make_manager(3)
    a = make_request("a", PROMPT[:8])
    prefill(m, a)
    m.free(a)
    assert free_ids(m) == [2, 1, 0]
    assert cached_ids(m) == [0, 1]

    # 13 tokens: 2 hit blocks (both in the free queue) + 2 fresh = 4 blocks > 3.
    b = make_request("b", PROMPT[:8] + [1, 2, 3, 4, 5])
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit == 8
    assert not m.allocate_slots(b, 5, hits)
    assert m.get_block_ids("b") == []
    assert free_ids(m) == [2, 1, 0]
    assert ref_cnts(m) == [0, 0, 0]
    assert cached_ids(m) == [0, 1]

    # 12 tokens: 2 hits + 1 fresh fits exactly; the fresh block is not a hit block.
    c = make_request("c", PROMPT[:8] + [1, 2, 3, 4])
    hits, num_hit = m.get_computed_blocks(c)
    assert m.allocate_slots(c, c.num_tokens - num_hit, hits)
    assert m.get_block_ids("c") == [0, 1, 2]
    assert ref_cnts(m) == [1, 1, 1]
    assert free_ids(m) == []


# ---- prefix lookup ----------------------------------------------------------------------


def test_prefix_hits_full_blocks_only_and_never_the_last_token():
    m = make_manager(16)
    a = make_request("a", PROMPT)
    assert prefill(m, a) == 0
    assert m.get_block_ids("a") == [0, 1, 2]
    assert m.pool.cached == dict(zip(chain(PROMPT), m.pool.blocks[:3]))
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (12, 0)

    # Same 12 tokens (3 * BS): the last token must be computed, so only 2 blocks hit.
    hits, num_hit = m.get_computed_blocks(make_request("b", PROMPT))
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit == 8
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (24, 8)

    # One more token: all three blocks hit.
    hits, num_hit = m.get_computed_blocks(make_request("c", PROMPT + [7]))
    assert [blk.block_id for blk in hits] == [0, 1, 2]
    assert num_hit == 12
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (37, 20)

    # A partial last block never hits.
    hits, num_hit = m.get_computed_blocks(make_request("d", PROMPT[:10]))
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit == 8
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (47, 16 + 12)

    # Divergence in block 1 stops the match there, even if block 2 matches.
    e_prompt = PROMPT[:4] + [1, 2, 3, 4] + PROMPT[8:] + [7]
    hits, num_hit = m.get_computed_blocks(make_request("e", e_prompt))
    assert [blk.block_id for blk in hits] == [0]
    assert num_hit == 4
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (60, 32)

    # Lookups take no references.
    assert ref_cnts(m)[:3] == [1, 1, 1]


def test_short_prompt_never_hits():
    m = make_manager(4)
    prefill(m, make_request("a", PROMPT[:4]))
    assert cached_ids(m) == [0]
    hits, num_hit = m.get_computed_blocks(make_request("b", PROMPT[:4]))
    assert (hits, num_hit) == ([], 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (8, 0)


def test_cache_salt_isolates():
    m = make_manager(16)
    prefill(m, make_request("a", PROMPT, cache_salt="alice"))
    assert m.pool.cached == dict(zip(chain(PROMPT, "alice"), m.pool.blocks[:3]))

    for rid, salt in [("b", None), ("c", "bob")]:
        hits, num_hit = m.get_computed_blocks(make_request(rid, PROMPT + [7], cache_salt=salt))
        assert (hits, num_hit) == ([], 0)
    # The salt is in block 0's hash only, but every later block's chain differs too.
    assert not set(m.req_hashes["a"]) & set(m.req_hashes["b"])

    hits, num_hit = m.get_computed_blocks(make_request("d", PROMPT + [7], cache_salt="alice"))
    assert [blk.block_id for blk in hits] == [0, 1, 2]
    assert num_hit == 12


def test_prompt_logprobs_requests_skip_the_cache():
    m = make_manager(16)
    prefill(m, make_request("a", PROMPT))
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (12, 0)

    b = make_request("b", PROMPT + [7], prompt_logprobs=1)
    assert m.get_computed_blocks(b) == ([], 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (12, 0)
    # It still computes every token, and its full blocks are still published (first wins).
    assert prefill(m, b) == 0
    assert m.get_block_ids("b") == [3, 4, 5, 6]
    assert cached_ids(m) == [0, 1, 2]


def test_caching_disabled():
    m = make_manager(8, enable_caching=False)
    a = make_request("a", PROMPT)
    prefill(m, a)
    assert m.pool.cached == {}
    m.free(a)
    assert m.get_computed_blocks(make_request("b", PROMPT + [7])) == ([], 0)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (0, 0)


def test_cache_blocks_publishes_newly_full_computed_blocks():
    m = make_manager(8)
    req = make_request("a", list(range(100, 110)))
    assert m.allocate_slots(req, 10)
    hashes = chain(req.all_token_ids)

    req.num_computed_tokens = 3
    m.cache_blocks(req)
    assert m.pool.cached == {}

    req.num_computed_tokens = 5
    m.cache_blocks(req)
    assert m.pool.cached == {hashes[0]: m.pool.blocks[0]}
    assert m.num_cached_blocks["a"] == 1

    req.num_computed_tokens = 10
    m.cache_blocks(req)
    assert m.pool.cached == {hashes[0]: m.pool.blocks[0], hashes[1]: m.pool.blocks[1]}
    assert m.num_cached_blocks["a"] == 2
    assert m.pool.blocks[2].block_hash is None  # partial


def test_duplicate_content_first_request_wins():
    m = make_manager(8)
    a, b = make_request("a", PROMPT[:8] + [1]), make_request("b", PROMPT[:8] + [1])
    # Both scheduled in the same step: nothing is cached yet, so no hits.
    for req in (a, b):
        hits, num_hit = m.get_computed_blocks(req)
        assert num_hit == 0
        assert m.allocate_slots(req, req.num_tokens, hits)
        req.num_computed_tokens = req.num_tokens
    m.cache_blocks(a)
    m.cache_blocks(b)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert m.get_block_ids("b") == [3, 4, 5]
    assert m.pool.cached == dict(zip(chain(PROMPT[:8]), m.pool.blocks[:2]))
    assert [m.pool.blocks[i].block_hash for i in (3, 4)] == [None, None]


# ---- free and reuse ---------------------------------------------------------------------


def test_free_releases_in_reverse_order():
    m = make_manager(6)
    a = make_request("a", PROMPT[:10])
    prefill(m, a)
    assert m.get_block_ids("a") == [0, 1, 2]
    assert free_ids(m) == [3, 4, 5]

    m.free(a)
    assert free_ids(m) == [3, 4, 5, 2, 1, 0]
    assert ref_cnts(m) == [0] * 6
    assert m.get_block_ids("a") == []
    assert "a" not in m.num_cached_blocks
    assert cached_ids(m) == [0, 1]  # full blocks stay cached while free

    # Eviction takes never-used blocks first, then the request's tail before its head.
    x = make_request("x", list(range(500, 516)))
    assert m.allocate_slots(x, 16)
    assert m.get_block_ids("x") == [3, 4, 5, 2]
    assert cached_ids(m) == [0, 1]
    y = make_request("y", [1])
    assert m.allocate_slots(y, 1)
    assert m.get_block_ids("y") == [1]
    assert m.pool.blocks[1].block_hash is None
    assert cached_ids(m) == [0]
    assert free_ids(m) == [0]


def test_free_of_finished_request_drops_its_hashes_preempted_keeps_them():
    m = make_manager(8)
    a = make_request("a", PROMPT)
    prefill(m, a)
    m.free(a)  # still RUNNING: a preemption
    assert m.req_hashes["a"] == chain(PROMPT)
    prefill(m, a)
    a.status = RequestStatus.FINISHED_STOPPED
    m.free(a)
    assert "a" not in m.req_hashes
    assert "a" not in m.req_blocks


def test_second_request_reuses_freed_cached_blocks():
    m = make_manager(6)
    a = make_request("a", PROMPT[:10])
    prefill(m, a)
    m.free(a)
    assert free_ids(m) == [3, 4, 5, 2, 1, 0]

    b = make_request("b", PROMPT[:8] + [1, 2])
    assert prefill(m, b) == 8
    assert m.get_block_ids("b") == [0, 1, 3]
    assert ref_cnts(m) == [1, 1, 0, 1, 0, 0]
    assert free_ids(m) == [4, 5, 2]
    assert cached_ids(m) == [0, 1]
    assert b.num_computed_tokens == 10


def test_prefix_hit_on_a_running_request_shares_blocks():
    m = make_manager(8)
    a = make_request("a", PROMPT)
    prefill(m, a)
    b = make_request("b", PROMPT + [1, 2])
    assert prefill(m, b) == 12
    assert m.get_block_ids("b") == [0, 1, 2, 3]
    assert ref_cnts(m)[:4] == [2, 2, 2, 1]
    m.free(a)
    assert ref_cnts(m)[:4] == [1, 1, 1, 1]
    assert free_ids(m) == [4, 5, 6, 7]
    m.free(b)
    assert free_ids(m) == [4, 5, 6, 7, 3, 2, 1, 0]


# ---- fork and copy-on-write -------------------------------------------------------------


def fork_after_prompt(m: KVCacheManager, prompt: list[int], n: int) -> list[Request]:
    """Leader computes the prompt; n - 1 children fork from it, as the scheduler does."""
    reqs = [make_request("p" if i == 0 else f"p#{i}", prompt) for i in range(n)]
    prefill(m, reqs[0])
    for child in reqs[1:]:
        m.fork(reqs[0], child, reqs[0].num_computed_tokens)
        child.num_computed_tokens = reqs[0].num_computed_tokens
    return reqs


def test_fork_shares_blocks_and_copies_on_write():
    m = make_manager(8)
    parent, child = fork_after_prompt(m, PROMPT[:6], 2)
    assert m.get_block_ids("p") == [0, 1]
    assert m.get_block_ids("p#1") == [0, 1]
    assert ref_cnts(m)[:3] == [2, 2, 0]
    assert free_ids(m) == [2, 3, 4, 5, 6, 7]
    assert m.num_cached_blocks["p#1"] == 1

    parent.append_output_token(7)
    child.append_output_token(8)

    # Position 6 is in shared, partial block 1: the parent writes to a copy.
    assert m.allocate_slots(parent, 1)
    assert m.get_block_ids("p") == [0, 2]
    assert ref_cnts(m)[:3] == [2, 1, 1]
    assert free_ids(m) == [3, 4, 5, 6, 7]
    assert m.take_pending_copies() == [(1, 2)]
    assert m.take_pending_copies() == []

    # Block 1 is now the child's alone: it writes in place.
    assert m.allocate_slots(child, 1)
    assert m.get_block_ids("p#1") == [0, 1]
    assert m.take_pending_copies() == []
    assert ref_cnts(m)[:3] == [2, 1, 1]

    # Next decode step stays in the private blocks: no more copies.
    for req, tok in ((parent, 9), (child, 10)):
        req.num_computed_tokens += 1
        req.append_output_token(tok)
        assert m.allocate_slots(req, 1)
    assert m.take_pending_copies() == []
    assert m.get_block_ids("p") == [0, 2]
    assert m.get_block_ids("p#1") == [0, 1]

    m.free(parent)
    m.free(child)
    assert ref_cnts(m) == [0] * 8
    assert m.pool.num_free_blocks == 8


def test_fork_three_ways_last_sibling_writes_in_place():
    m = make_manager(8)
    reqs = fork_after_prompt(m, PROMPT[:6], 3)
    assert ref_cnts(m)[:2] == [3, 3]
    for i, req in enumerate(reqs):
        req.append_output_token(7 + i)
        assert m.allocate_slots(req, 1)
    assert m.take_pending_copies() == [(1, 2), (1, 3)]
    assert [m.get_block_ids(r.request_id) for r in reqs] == [[0, 2], [0, 3], [0, 1]]
    assert ref_cnts(m)[:4] == [3, 1, 1, 1]


def test_copy_on_write_fails_without_side_effects_when_pool_is_full():
    m = make_manager(2)
    parent, child = fork_after_prompt(m, PROMPT[:6], 2)
    parent.append_output_token(7)
    assert not m.allocate_slots(parent, 1)
    assert m.get_block_ids("p") == [0, 1]
    assert ref_cnts(m) == [2, 2]
    assert m.take_pending_copies() == []
    # Once the child is gone, the parent owns block 1 and writes in place.
    m.free(child)
    assert ref_cnts(m) == [1, 1]
    assert m.allocate_slots(parent, 1)
    assert m.get_block_ids("p") == [0, 1]
    assert m.take_pending_copies() == []


def test_no_copy_on_write_when_shared_prompt_is_block_aligned():
    m = make_manager(8)
    parent, child = fork_after_prompt(m, PROMPT[:8], 2)
    assert ref_cnts(m)[:2] == [2, 2]
    assert cached_ids(m) == [0, 1]
    for req, tok in ((parent, 7), (child, 8)):
        req.append_output_token(tok)
        assert m.allocate_slots(req, 1)
    assert m.take_pending_copies() == []
    assert m.get_block_ids("p") == [0, 1, 2]
    assert m.get_block_ids("p#1") == [0, 1, 3]
    assert ref_cnts(m)[:4] == [2, 2, 1, 1]


@pytest.mark.parametrize("num_tokens, expected", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_num_blocks_for(num_tokens: int, expected: int):
    assert make_manager(1).num_blocks_for(num_tokens) == expected


def test_block_id_lists_follow_blocks_through_every_change():
    """get_block_ids reads a list of ids kept beside the block lists: after prefix hits, growth,
    forks, copy-on-write, preemption and frees, the two agree."""

    def check(m: KVCacheManager) -> None:
        assert set(m.req_block_ids) == set(m.req_blocks)
        for rid, blocks in m.req_blocks.items():
            assert m.get_block_ids(rid) == [b.block_id for b in blocks]

    m = make_manager(16)
    a = make_request("a", PROMPT[:10])
    prefill(m, a)
    b = make_request("b", PROMPT[:9])
    assert prefill(m, b) == 8  # prefix hits
    check(m)
    parent, child = fork_after_prompt(m, PROMPT[:6], 2)
    check(m)
    for req, token in ((parent, 7), (child, 8)):  # both write into the shared block
        req.append_output_token(token)
        assert m.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert m.get_block_ids("p") != m.get_block_ids("p#1")
    check(m)
    for _ in range(5):  # growth across a block boundary, and steps that need no new block
        a.append_output_token(9)
        assert m.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        check(m)
    a.status = RequestStatus.PREEMPTED
    m.free(a)
    check(m)
    for req in (b, parent, child):
        req.status = RequestStatus.FINISHED_STOPPED
        m.free(req)
    check(m)
    assert m.req_block_ids == {}
