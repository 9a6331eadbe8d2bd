"""The KV connector's scheduler side, the engine's part of prefill/decode disaggregation
(--kv-transfer-config). It decides which blocks to fetch, load, stage or drop and sends that as
KVConnectorOps through the executor, whose worker side (distributed/kv_transfer.py, KVWorker)
holds the transport and every block's data and does the copies: this side holds no tensor.

Producer: the worker side's KVServer thread answers decode instances with blocks of this
engine's prefix cache. When a request that asked for remote decode (kv_transfer_params
do_remote_decode) finishes, its prompt's blocks are staged at once, still under the engine's
lock (a `saves` op): a fetch of them is answered from there without waiting for the engine's
current step. Other blocks are looked up here, in the prefix cache, under the engine's lock
(`_cached_blocks`), so never in the middle of a step.

Consumer: a request whose kv_transfer_params name a producer waits here, out of the scheduler,
while the worker side fetches its prompt's full blocks (those this engine's prefix cache lacks).
When they arrive, this side takes free blocks, has the worker side write the data into them (a
`loads` op) and publishes them in the prefix cache under their hashes; then the request enters
the scheduler, which finds them as cache hits and computes only the rest of the prompt (at least
its last token, whose logits give the next one). A fetch that failed after its retries leaves
the prefix cache as it was: the request is computed here as if nothing had been sent. Either
way the output is the one a colocated engine gives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from pagoda.kv_transfer_config import KVTransferConfig
from pagoda.runner.executor import Executor
from pagoda.scheduling.kv_cache_manager import KVCacheManager
from pagoda.scheduling.messages import EngineCoreOutput, KVConnectorOps, KVFetchDone
from pagoda.scheduling.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# How long an engine with nothing to run but fetches in flight waits for one, per step() call.
IDLE_WAIT_S = 0.01


class RemotePrefill:
    def __init__(
        self,
        config: KVTransferConfig,
        executor: Executor,
        manager: KVCacheManager,
        lock: threading.Lock,
    ) -> None:
        self.config = config
        self.executor = executor
        self.manager = manager
        self.lock = lock
        executor.start_kv_connector(config, self._cached_blocks)
        self.waiting: dict[str, Request] = {}  # fetching, by request id
        self.ready: list[Request] = []  # nothing to fetch: enter the scheduler next step
        # producer: the prompt block hashes of requests that asked for remote decode, until
        # they finish (then their blocks are staged)
        self.remote_decode: dict[str, list[bytes]] = {}

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
        self.executor.kv_connector(
            KVConnectorOps(fetches=[(request.request_id, source, hashes[held:])])
        )

    def take_ready(self, idle: bool) -> list[Request]:
        """Requests whose fetch is over (blocks published), to add to the scheduler; `idle`:
        nothing else runs, so wait a moment for a fetch rather than spin."""
        ready, self.ready = self.ready, []
        if not self.waiting:
            return ready
        wait_s = IDLE_WAIT_S if idle and not ready else 0.0
        loads: list[tuple[str, list[int]]] = []
        drops: list[str] = []
        for done in self.executor.kv_connector(KVConnectorOps(poll=True, wait_s=wait_s)):
            request = self.waiting.pop(done.request_id, None)
            block_ids = [] if request is None else self._publish(done)
            if block_ids:
                loads.append((done.request_id, block_ids))
            elif done.num_blocks:
                drops.append(done.request_id)  # aborted while fetching, or no free block
            if request is None:
                continue
            if done.error is not None:
                logger.warning(
                    "KV transfer for %s failed (%s): computing its prompt here",
                    done.request_id,
                    done.error,
                )
            ready.append(request)
        if loads or drops:
            self.executor.kv_connector(KVConnectorOps(loads=loads, drops=drops))
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

    def _publish(self, done: KVFetchDone) -> list[int]:
        """Take free blocks for the fetched ones and publish them in the prefix cache (free, so
        evictable, last in line: a request about to be scheduled reads them); their ids, which
        the worker side writes the data into before any step runs ([]: nothing to write)."""
        pool = self.manager.pool
        count = min(done.num_blocks, pool.num_free_blocks)
        if count == 0:
            return []
        blocks = pool.get_new_blocks(count)
        for block, block_hash in zip(blocks, done.hashes):
            pool.cache_full_block(block, block_hash)
        pool.free_blocks(reversed(blocks))  # the chain's tail is evicted first
        return [b.block_id for b in blocks]

    # ---- producer ------------------------------------------------------------------------------
    def expect_remote_decode(self, request: Request) -> None:
        """The request asked for remote decode: stage its prompt's blocks when it finishes."""
        bs = self.manager.block_size
        hashes = self.manager.block_hashes(request, (request.num_tokens - 1) // bs)
        self.remote_decode[request.request_id] = list(hashes)

    def stage_finished(self, outputs: list[EngineCoreOutput]) -> None:
        """Under the engine's lock, after a step: have the worker side copy out the prompt
        blocks of the finished requests that asked for remote decode (still in the prefix
        cache, just freed)."""
        saves: list[tuple[list[int], list[bytes]]] = []
        for out in outputs:
            if out.finish_reason is None:
                continue
            hashes = self.remote_decode.pop(out.request_id, None)
            ids, held = self._cached_run(hashes or [])
            if ids:
                saves.append((ids, held))
        if saves:
            self.executor.kv_connector(KVConnectorOps(saves=saves))

    def _cached_run(self, hashes: list[bytes]) -> tuple[list[int], list[bytes]]:
        """Block ids and hashes of the longest run of `hashes` the prefix cache holds."""
        ids: list[int] = []
        for block_hash in hashes:
            block = self.manager.pool.get_cached_block(block_hash)
            if block is None:
                break
            ids.append(block.block_id)
        return ids, hashes[: len(ids)]

    def _cached_blocks(
        self, hashes: list[bytes], read: Callable[[list[int]], list[torch.Tensor]]
    ) -> list[torch.Tensor]:
        """For the worker side's server thread: `read` of the longest run of `hashes` the prefix
        cache holds, under the engine's lock ([] when it holds none)."""
        with self.lock:
            ids, _ = self._cached_run(hashes)
            return read(ids) if ids else []

    # ---- both ----------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.ready)

    def holds(self, request_id: str) -> bool:
        """Whether the request waits here (fetching, or about to enter the scheduler)."""
        return request_id in self.waiting or any(r.request_id == request_id for r in self.ready)

    def stats_dict(self) -> dict[str, float]:
        return self.executor.kv_transfer_stats()

    def close(self) -> None:
        self.executor.close_kv_connector()
