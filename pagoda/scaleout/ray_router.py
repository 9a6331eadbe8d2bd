"""Ray Serve's request router for pagoda's engine replicas: prefix-aware (routing.py) over Ray's
view of each replica's queue (its requests in flight), so prefix caching survives scale-out.

Configured on the engine deployment as `RequestRouterConfig(request_router_class=
"pagoda.scaleout.ray_router:PrefixAwareRouter", request_router_kwargs={"max_imbalance": 4})`.
The request's routing key is the `prefix_key` of its first argument (a ForwardedRequest); a
request that names a replica (its `replica`, from the x-pagoda-replica header) goes to that one
while it is a candidate, and is routed by its key when it is not (the response names the replica
that served it).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from pagoda.scaleout.routing import choose_replica


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """The replica that wins the prompt prefix's rendezvous hash unless it is busier than the
    least-loaded one by more than max_imbalance requests; ranked after it, the others by load
    (Ray tries the next rank when a replica is at max_ongoing_requests)."""

    def initialize_state(self, max_imbalance: int = 4, **kwargs: Any) -> None:
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.max_imbalance = max_imbalance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pinned = _pin_of(pending_request)
        for r in candidate_replicas:
            if pinned is not None and r.replica_id.unique_id == pinned:
                return [[r]]
        loads = await self._loads(candidate_replicas)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        key = _key_of(pending_request)
        chosen = choose_replica(key, loads, self.max_imbalance)
        rest = sorted((r for r in by_id if r != chosen), key=lambda r: (loads[r], r))
        return [[by_id[chosen]], [by_id[r] for r in rest]]

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Each replica's requests in flight, from Ray's cache, probing the ones it lacks; a
        replica that does not answer counts as full."""
        loads: dict[str, int] = {}
        missing = []
        for r in replicas:
            cached = self._replica_queue_len_cache.get(r.replica_id)
            if cached is None:
                missing.append(r)
            else:
                loads[r.replica_id.to_full_id_str()] = cached
        if missing:
            for r, queue_len in await self._probe_queue_lens(missing, 0):
                full = r.max_ongoing_requests
                loads[r.replica_id.to_full_id_str()] = full if queue_len is None else queue_len
        return loads


def _pin_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    replica = getattr(pending_request.args[0], "replica", None)
    return replica if isinstance(replica, str) else None


def _key_of(pending_request: PendingRequest | None) -> bytes | None:
    if pending_request is None or not pending_request.args:
        return None
    key = getattr(pending_request.args[0], "prefix_key", None)
    return key if isinstance(key, bytes) else None
