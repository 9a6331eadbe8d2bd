"""The engine's side of prefill/decode disaggregation (--kv-transfer-config).

Producer: a KVServer thread answers decode instances with blocks of this engine's prefix cache;
it reads the pool and the caches under the engine's lock, so never in the middle of a step.

Consumer: a request whose kv_transfer_params name a producer waits here, out of the scheduler,
while a KVFetcher thread fetches its prompt's full blocks (those this engine's prefix cache lacks).
When they arrive, they are written into free blocks and published in the prefix cache under
their hashes, then the request enters the scheduler, which finds them as cache hits and computes
only the rest of the prompt (at least its last token, whose logits give the next one). A fetch
that failed after its retries leaves the prefix cache as it was: the request is computed here as
if nothing had been sent. Either way the output is the one a colocated engine gives.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict

import torch

from pagoda.distributed.kv_transfer import (
    FetchResult,
    KVTransferStats,
    cache_layout,
    gather_blocks,
    make_connector,
    scatter_blocks,
)
from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.layers.kv_cache import KVCache
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# How long an engine with nothing to run but fetches in flight waits for one, per step() call.
IDLE_WAIT_S = 0.01


class RemotePrefill:
    def __init__(
        self,
        config: KVTransferConfig,
        kv_caches: list[KVCache],
        manager: KVCacheManager,
        lock: threading.Lock,
    ) -> None:
        self.config = config
        self.kv_caches = kv_caches
        self.manager = manager
        self.lock = lock
        self.stats = KVTransferStats()
        self.connector = make_connector(
            config, cache_layout(kv_caches), self._read_blocks, self.stats
        )
        self.waiting: dict[str, Request] = {}  # fetching, by request id
        self.ready: list[Request] = []  # nothing to fetch: enter the scheduler next step

    # ---- consumer ------------------------------------------------------------------------------
    def add(self, request: Request, source: tuple[str, int]) -> None:
        """Fetch the request's prompt blocks from `source` before it is scheduled."""
        bs = self.manager.block_size
        # the full blocks a prefix-cache hit may cover (at least one token is left to compute)
        hashes = self.manager.block_hashes(request, (request.num_tokens - 1) // bs)
        pool = self.manager.pool
        held = 0
        while held < len(hashes) and pool.get_cached_block(hashes[held]) is not None:
            held += 1
        if held == len(hashes) or request.sampling_params.prompt_logprobs is not None:
            self.ready.append(request)  # nothing to fetch, or it would not be read
            return
        self.waiting[request.request_id] = request
        self.stats.fetches += 1
        self.connector.start_fetch(request.request_id, source, hashes[held:])

    def take_ready(self, idle: bool) -> list[Request]:
        """Requests whose fetch is over (blocks published), to add to the scheduler; `idle`:
        nothing else runs, so wait a moment for a fetch rather than spin."""
        ready, self.ready = self.ready, []
        if not self.waiting:
            return ready
        for result in self.connector.finished_fetches(IDLE_WAIT_S if idle and not ready else 0.0):
            request = self.waiting.pop(result.request_id, None)
            if request is None:
                continue  # aborted while fetching
            if result.error is not None:
                logger.warning(
                    "KV transfer for %s failed (%s): computing its prompt here",
                    result.request_id,
                    result.error,
                )
            self._publish(result)
            ready.append(request)
        return ready

    def abort(self, request_ids: list[str]) -> list[Request]:
        """Drop waiting requests; returns those that were waiting."""
        dropped = [self.waiting.pop(r) for r in request_ids if r in self.waiting]
        dropped += [r for r in self.ready if r.request_id in request_ids]
        self.ready = [r for r in self.ready if r.request_id not in request_ids]
        for request in dropped:
            request.status = RequestStatus.FINISHED_ABORTED
            self.manager.free(request)  # forgets its hashes
        return dropped

    def _publish(self, result: FetchResult) -> None:
        """Write the fetched blocks into free blocks and publish them in the prefix cache (free,
        so evictable, last in line: a request about to be scheduled reads them)."""
        pool = self.manager.pool
        count = min(result.num_blocks, pool.num_free_blocks)
        if count == 0:
            return
        blocks = pool.get_new_blocks(count)
        scatter_blocks(self.kv_caches, [b.block_id for b in blocks], result.data)
        for block, block_hash in zip(blocks, result.hashes):
            pool.cache_full_block(block, block_hash)
        pool.free_blocks(reversed(blocks))  # the chain's tail is evicted first

    # ---- producer ------------------------------------------------------------------------------
    def _read_blocks(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """Under the engine's lock: the longest run of `hashes` the prefix cache holds, copied
        out of every layer's cache ([] when it holds none)."""
        with self.lock:
            ids: list[int] = []
            for block_hash in hashes:
                block = self.manager.pool.get_cached_block(block_hash)
                if block is None:
                    break
                ids.append(block.block_id)
            return gather_blocks(self.kv_caches, ids) if ids else []

    # ---- both ----------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.ready)

    def holds(self, request_id: str) -> bool:
        """Whether the request waits here (fetching, or about to enter the scheduler)."""
        return request_id in self.waiting or any(r.request_id == request_id for r in self.ready)

    def stats_dict(self) -> dict[str, float]:
        return asdict(self.stats)

    def close(self) -> None:
        self.connector.close()
