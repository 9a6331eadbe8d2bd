"""Per-request block tables over the block pool: prefix lookup, allocation, fork, copy-on-write.

A request's blocks cover its tokens in order; block j holds positions [j*B, (j+1)*B).

    blocks:   | full, cached | full, cached | full | partial |  new (this step) ...
    tokens:   |<----------- num_computed_tokens ----------->|<- num_new_tokens ->|
              |<- num_cached_blocks*B ->|

Only the block holding position `num_computed_tokens` and the blocks after it are written this
step; full blocks are immutable. A written block shared with another request (ref_cnt > 1, after
a fork) is first copied to a fresh block (copy-on-write); the copy is reported to the model runner
through `take_pending_copies()` and must be done before the step's forward pass.
"""

from __future__ import annotations

from pagoda.scheduling.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from pagoda.scheduling.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # The ids of req_blocks, kept in step. Each list is replaced, never mutated, when the
        # blocks change: get_block_ids hands it out as a snapshot without copying.
        self.req_block_ids: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids now (callers must not mutate the list)."""
        return self.req_block_ids.get(request_id, [])

    def block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first `num_full_blocks` blocks, extending its chain lazily."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            j = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = request.hash_extra if j == 0 else None
            hashes.append(
                hash_block_tokens(parent, request.all_token_ids[j * bs : (j + 1) * bs], extra)
            )
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks; at least one token is always left to compute."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request, max_blocks):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Make the request's blocks cover its computed tokens plus `num_new_tokens`.

        `new_computed_blocks` are prefix-cache hits (first scheduling only); the caller advances
        num_computed_tokens past them. Returns False, changing nothing, if the pool is too small.
        """
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        self.req_block_ids.setdefault(rid, [])
        new_computed_blocks = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_have = len(blocks) + len(new_computed_blocks)
        cow_index = self._cow_index(blocks, num_computed)
        if num_required <= num_have and cow_index is None and not new_computed_blocks:
            return True  # most decode steps: the tokens land in a block the request owns
        num_fresh = max(0, num_required - num_have)
        num_needed = (
            num_fresh
            + (cow_index is not None)
            + sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        )
        if num_needed > self.pool.num_free_blocks:
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if cow_index is not None:
            self._copy_on_write(blocks, cow_index)
        blocks.extend(self.pool.get_new_blocks(num_fresh))
        self.req_block_ids[rid] = [b.block_id for b in blocks]
        return True

    def _cow_index(self, blocks: list[KVCacheBlock], num_computed: int) -> int | None:
        """Index of the shared, partially filled block the next token would be written into."""
        j = num_computed // self.block_size
        if j < len(blocks) and blocks[j].ref_cnt > 1:
            assert blocks[j].block_hash is None, "a cached full block is never written"
            return j
        return None

    def _copy_on_write(self, blocks: list[KVCacheBlock], j: int) -> None:
        (fresh,) = self.pool.get_new_blocks(1)
        self.pending_copies.append((blocks[j].block_id, fresh.block_id))
        self.pool.free_blocks([blocks[j]])
        blocks[j] = fresh

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Child shares the parent's blocks of its first num_tokens tokens (ref counts up);
        writes into a shared block will copy-on-write."""
        blocks = self.req_blocks[parent.request_id][: cdiv(num_tokens, self.block_size)]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self.req_block_ids[child.request_id] = [b.block_id for b in blocks]
        num_cached = self.num_cached_blocks.get(parent.request_id, 0)
        self.num_cached_blocks[child.request_id] = min(num_cached, len(blocks))

    def cache_blocks(self, request: Request) -> None:
        """Publish the request's newly full blocks of computed, known tokens to the prefix
        cache (computed tokens may run ahead of the known ones by a placeholder)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        blocks = self.req_blocks[rid]
        hashes = self.block_hashes(request, num_full)
        for j in range(start, num_full):
            self.pool.cache_full_block(blocks[j], hashes[j])
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes first so it is evicted first."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.req_block_ids.pop(rid, None)
        self.pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(rid, None)
        # Hashes depend only on tokens, so they stay valid for a preempted request's recompute.
        if request.is_finished:
            self.req_hashes.pop(rid, None)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)
