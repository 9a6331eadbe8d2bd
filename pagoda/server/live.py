"""The live view's feed: GET /v1/engine/events, server-sent events of the engine's state (the
KV block pool, the queues, the last step's token budget; scheduling/snapshot.py) and of the
numbers /metrics serves (latency percentiles, token totals, queues, KV usage), one every
`interval_s` a client asks for (?interval_s=, MIN_INTERVAL_S to MAX_INTERVAL_S, default
MIN_INTERVAL_S). The engine builds snapshots only while at least one client is connected, at the
shortest interval any of them asked for: the first to connect turns them on
(AsyncEngine.watch), the last to leave turns them off.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from pagoda.client.async_client import AsyncEngine
from pagoda.server.errors import APIError
from pagoda.server.metrics import Metrics

MIN_INTERVAL_S = 0.2
MAX_INTERVAL_S = 60.0
# /metrics histograms whose percentiles an event carries
LATENCIES = {
    "ttft": "pagoda:time_to_first_token_seconds",
    "itl": "pagoda:inter_token_latency_seconds",
    "e2e": "pagoda:e2e_request_latency_seconds",
}
QUANTILES = (0.5, 0.9, 0.99)


class Watchers:
    """The intervals the feed's clients asked for; the engine snapshots at the shortest while
    there is one."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.intervals: list[float] = []
        self.current = 0.0  # what the engine was last asked for (0: off)

    def join(self, interval_s: float = MIN_INTERVAL_S) -> None:
        self.intervals.append(interval_s)
        self._update()

    def leave(self, interval_s: float = MIN_INTERVAL_S) -> None:
        self.intervals.remove(interval_s)
        self._update()
        if not self.intervals:
            self.engine.snapshot = None

    def _update(self) -> None:
        wanted = min(self.intervals, default=0.0)
        if wanted != self.current:
            self.engine.watch(wanted)
            self.current = wanted


def check_interval(interval_s: float) -> None:
    """A 400 for an interval out of range (NaN included)."""
    if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
        raise APIError(
            400,
            f"interval_s must be between {MIN_INTERVAL_S} and {MAX_INTERVAL_S} seconds, "
            f"got {interval_s}",
            "interval_s",
        )


def event_stream(
    request: Request,
    engine: AsyncEngine,
    metrics: Metrics,
    watchers: Watchers,
    interval_s: float = MIN_INTERVAL_S,
) -> StreamingResponse:
    """The feed for one client, an event every interval_s (the latest snapshot then)."""
    check_interval(interval_s)

    async def events() -> AsyncIterator[str]:
        watchers.join(interval_s)
        try:
            last: Any = None  # the client's latest EngineSnapshot
            sent = -math.inf
            while not await request.is_disconnected():
                snapshot = engine.snapshot
                # a snapshot comes every shortest interval: take the first one due
                due = time.monotonic() - sent >= interval_s - MIN_INTERVAL_S / 2
                if snapshot is not None and snapshot is not last and due:
                    last, sent = snapshot, time.monotonic()
                    yield f"data: {json.dumps(payload(snapshot, metrics))}\n\n"
                await asyncio.sleep(MIN_INTERVAL_S / 4)
        finally:
            watchers.leave(interval_s)

    return StreamingResponse(events(), media_type="text/event-stream")


def payload(snapshot: Any, metrics: Metrics) -> dict[str, Any]:
    """One event: {"engine": the EngineSnapshot's fields (scheduling/messages.py), "metrics":
    live_numbers(metrics)}."""
    engine = msgspec.structs.asdict(snapshot)
    engine["requests"] = [msgspec.structs.asdict(r) for r in snapshot.requests]
    return {"engine": engine, "metrics": live_numbers(metrics)}


def live_numbers(metrics: Metrics) -> dict[str, Any]:
    """From the same collectors /metrics renders: p50 / p90 / p99 of TTFT, ITL and E2E (as
    Prometheus' histogram_quantile estimates them from the buckets; None before any sample),
    token totals, queues and KV usage."""
    families = {f.name: f for f in metrics.registry.collect()}
    out: dict[str, Any] = {}
    for key, name in LATENCIES.items():
        family = families.get(name)
        buckets = sorted(
            (float(s.labels["le"]), s.value)
            for s in (family.samples if family else [])
            if s.name.endswith("_bucket")
        )
        out[key] = {f"p{round(q * 100)}": histogram_quantile(q, buckets) for q in QUANTILES}
    out.update(metrics.totals())
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' estimate from cumulative buckets (upper bound, count), sorted by bound:
    linear within the bucket holding the rank; the largest finite bound past it."""
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound
