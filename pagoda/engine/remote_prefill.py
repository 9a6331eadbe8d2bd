"""The engine's side of prefill/decode disaggregation (--kv-transfer-config).

Producer: a KVServer thread answers decode instances with blocks of this engine's prefix cache.
When a request that asked for remote decode (kv_transfer_params do_remote_decode) finishes, its
prompt's blocks are copied out at once, still under the engine's lock (the staging area, at most
STAGE_BYTES, oldest dropped first): a fetch of them is answered from there without waiting for
the engine's current step. Other blocks are read from the pool and the caches under the engine's
lock, so never in the middle of a step.

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
from collections import OrderedDict
from dataclasses import asdict

import torch

from pagoda.distributed.kv_transfer import FetchResult, KVTransferStats, make_connector
from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.runner.executor import Executor
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.messages import EngineCoreOutput
from pagoda.scheduling.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# How long an engine with nothing to run but fetches in flight waits for one, per step() call.
IDLE_WAIT_S = 0.01
# Bytes of prompt blocks a producer keeps staged for decode instances to fetch.
STAGE_BYTES = 1 << 30


class RemotePrefill:
    def __init__(
        self,
        config: KVTransferConfig,
        executor: Executor,
        manager: KVCacheManager,
        lock: threading.Lock,
    ) -> None:
        """executor: the worker side, which copies blocks out of and into its caches; this
        side decides which blocks (the prefix cache's) and holds only host copies."""
        self.config = config
        self.executor = executor
        self.manager = manager
        self.lock = lock
        self.stats = KVTransferStats()
        self.connector = make_connector(config, executor.kv_layout(), self._read_blocks, self.stats)
        self.waiting: dict[str, Request] = {}  # fetching, by request id
        self.ready: list[Request] = []  # nothing to fetch: enter the scheduler next step
        # producer: the prompt block hashes of requests that asked for remote decode, until
        # they finish; then their blocks' data (one tensor per cache tensor) by hash
        self.remote_decode: dict[str, list[bytes]] = {}
        self.staged: OrderedDict[bytes, list[torch.Tensor]] = OrderedDict()
        self.staged_bytes = 0
        self.stage_lock = threading.Lock()  # the engine thread stages, the server thread reads

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
        for rid in request_ids:
            self.remote_decode.pop(rid, None)
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
        self.executor.write_blocks([b.block_id for b in blocks], result.data)
        for block, block_hash in zip(blocks, result.hashes):
            pool.cache_full_block(block, block_hash)
        pool.free_blocks(reversed(blocks))  # the chain's tail is evicted first

    # ---- producer ------------------------------------------------------------------------------
    def expect_remote_decode(self, request: Request) -> None:
        """The request asked for remote decode: stage its prompt's blocks when it finishes."""
        bs = self.manager.block_size
        hashes = self.manager.block_hashes(request, (request.num_tokens - 1) // bs)
        self.remote_decode[request.request_id] = list(hashes)

    def stage_finished(self, outputs: list[EngineCoreOutput]) -> None:
        """Under the engine's lock, after a step: copy out the prompt blocks of the finished
        requests that asked for remote decode (still in the prefix cache, just freed)."""
        for out in outputs:
            if out.finish_reason is None:
                continue
            hashes = self.remote_decode.pop(out.request_id, None)
            if not hashes:
                continue
            ids, held = self._cached_run(hashes)
            if not ids:
                continue
            # one copy per request; each block's entries are views into it (a request's blocks
            # are staged, and so dropped, together)
            data = self.executor.read_blocks(ids)
            with self.stage_lock:
                for i, block_hash in enumerate(held):
                    blocks = [t[i] for t in data]
                    if self.staged.pop(block_hash, None) is None:
                        self.staged_bytes += sum(b.numel() * b.element_size() for b in blocks)
                    self.staged[block_hash] = blocks
                while self.staged_bytes > STAGE_BYTES and self.staged:
                    _, old = self.staged.popitem(last=False)
                    self.staged_bytes -= sum(b.numel() * b.element_size() for b in old)

    def _cached_run(self, hashes: list[bytes]) -> tuple[list[int], list[bytes]]:
        """Block ids and hashes of the longest run of `hashes` the prefix cache holds."""
        ids: list[int] = []
        for block_hash in hashes:
            block = self.manager.pool.get_cached_block(block_hash)
            if block is None:
                break
            ids.append(block.block_id)
        return ids, hashes[: len(ids)]

    def _read_blocks(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """The longest run of `hashes` this engine holds, one tensor per cache tensor ([] when
        it holds none): from the staging area when it starts there, else from the prefix cache
        under the engine's lock."""
        with self.stage_lock:
            run = []
            for block_hash in hashes:
                blocks = self.staged.get(block_hash)
                if blocks is None:
                    break
                run.append(blocks)
        if run:
            return [torch.stack(parts) for parts in zip(*run)]
        with self.lock:
            ids, _ = self._cached_run(hashes)
            return self.executor.read_blocks(ids) if ids else []

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
