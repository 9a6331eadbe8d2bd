"""The engine's state for the live view (GET /v1/engine/events): every KV block's state, ref
count and owner, and the queues with each request's computed / total tokens. Built only while
a client watches (messages.WatchRequest), at most every interval: O(blocks + requests)."""

from __future__ import annotations

import time
from typing import Any

from pagoda.scheduling.messages import EngineSnapshot, SnapshotRequest
from pagoda.scheduling.request import RequestStatus

FREE, CACHED, HELD = 0, 1, 2


def build_snapshot(scheduler: Any) -> EngineSnapshot:
    """`scheduler`: scheduling.scheduler.Scheduler."""
    kv = scheduler.kv
    pool = kv.pool
    queued = [*scheduler.running, *scheduler.waiting]
    requests = [
        SnapshotRequest(
            r.request_id,
            _queue(r.status),
            r.num_computed_tokens,
            r.num_tokens,
            r.priority,
            r.num_preemptions,
            r.num_cached_tokens,
            "" if r.lora_request is None else r.lora_request.lora_name,
        )
        for r in queued
    ]
    owner = [-1] * pool.num_blocks
    for i, r in enumerate(queued):
        for block_id in kv.get_block_ids(r.request_id):
            if owner[block_id] < 0:
                owner[block_id] = i
    blocks = pool.blocks
    return EngineSnapshot(
        time=time.time(),
        step_id=scheduler.step_id,
        block_size=kv.block_size,
        block_state=[
            HELD if b.ref_cnt else CACHED if b.block_hash is not None else FREE for b in blocks
        ],
        block_ref_cnt=[b.ref_cnt for b in blocks],
        block_owner=owner,
        requests=requests,
        num_scheduled_tokens=scheduler.last_num_scheduled_tokens,
        max_num_batched_tokens=scheduler.config.max_num_batched_tokens,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
    )


def _queue(status: RequestStatus) -> str:
    if status == RequestStatus.RUNNING:
        return "running"
    return "preempted" if status == RequestStatus.PREEMPTED else "waiting"
