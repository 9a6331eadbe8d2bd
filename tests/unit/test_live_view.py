"""The live view's pieces without a server: engine snapshots of the block pool and queues
(scheduling/snapshot.py) on a scripted scheduler, the engine loop building them only while a
client watches and at most every interval, the watcher count that turns them on and off, and
the percentile estimate from /metrics' histogram buckets (server/live.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.engine.process import EngineLoop
from pagoda.scheduling.messages import WatchRequest
from pagoda.scheduling.snapshot import CACHED, FREE, HELD, build_snapshot
from pagoda.server.live import Watchers, histogram_quantile
from tests.unit.test_scheduler import make_request, make_scheduler, prompt, step


def test_a_snapshot_shows_each_block_its_owner_and_the_queues() -> None:
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=15)
    a = make_request("a", prompt(1, 8), arrival=0, max_tokens=1)  # two full blocks of 4
    b = make_request("b", prompt(2, 7), arrival=1, max_tokens=4)
    c = make_request("c", prompt(3, 9), arrival=2, max_tokens=4)  # no budget left: waits
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)  # a and b prefill (the 15 tokens); a finishes; its full blocks stay cached
    snap = build_snapshot(sched)
    assert snap.num_scheduled_tokens == 15 and snap.max_num_batched_tokens == 15
    assert [
        (r.request_id, r.queue, r.num_computed_tokens, r.num_tokens) for r in snap.requests
    ] == [
        ("b", "running", 7, 8),
        ("c", "waiting", 0, 9),
    ]
    b_blocks = sched.kv.get_block_ids("b")
    for i in range(6):
        if i in b_blocks:
            assert (snap.block_state[i], snap.block_ref_cnt[i], snap.block_owner[i]) == (HELD, 1, 0)
        else:
            assert snap.block_ref_cnt[i] == 0 and snap.block_owner[i] == -1
    cached = [i for i in range(6) if snap.block_state[i] == CACHED]
    assert len(cached) == 2 and not set(cached) & set(b_blocks)  # a's two full prompt blocks
    assert snap.block_state.count(FREE) == 6 - len(b_blocks) - 2
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (8 + 7, 0)


def test_prefix_cache_hits_show_per_request_and_as_shared_blocks() -> None:
    sched = make_scheduler(num_blocks=8)
    shared = prompt(1, 8)  # two full blocks of 4
    a = make_request("a", [*shared, 50], arrival=0, max_tokens=4)
    sched.add_request(a)
    step(sched)
    b = make_request("b", [*shared, 60], arrival=1, max_tokens=4)
    sched.add_request(b)
    waiting = build_snapshot(sched).requests[1]
    assert (waiting.request_id, waiting.num_cached_tokens) == ("b", -1)  # not admitted yet
    step(sched)
    snap = build_snapshot(sched)
    assert [(r.request_id, r.num_cached_tokens) for r in snap.requests] == [("a", 0), ("b", 8)]
    common = sched.kv.get_block_ids("a")[:2]
    assert common == sched.kv.get_block_ids("b")[:2]
    for i in common:  # held by both: a (index 0 in requests) is its owner
        assert (snap.block_state[i], snap.block_ref_cnt[i], snap.block_owner[i]) == (HELD, 2, 0)
    assert snap.prefix_cache_hits == 8


class _Engine:
    def __init__(self) -> None:
        self.scheduler = make_scheduler()
        self.built = 0


def test_the_engine_loop_builds_snapshots_only_while_watched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = _Engine()
    loop = EngineLoop(engine, None, None)  # type: ignore[arg-type]
    built: list[int] = []

    def counting(scheduler: Any) -> Any:
        built.append(1)
        return build_snapshot(scheduler)

    monkeypatch.setattr("pagoda.engine.process.build_snapshot", counting)
    clock = [100.0]
    monkeypatch.setattr("pagoda.engine.process.time.monotonic", lambda: clock[0])
    assert loop._snapshot_due() is None and not built  # nobody watches: nothing is built
    loop.watch_interval_s, loop.last_snapshot = WatchRequest(0.2).interval_s, 0.0
    assert loop._snapshot_due() is not None
    clock[0] += 0.1
    assert loop._snapshot_due() is None  # within the interval
    clock[0] += 0.15
    assert loop._snapshot_due() is not None
    loop.watch_interval_s = 0.0
    clock[0] += 5
    assert loop._snapshot_due() is None and len(built) == 2


class _Watched:
    def __init__(self) -> None:
        self.intervals: list[float] = []
        self.snapshot: Any = object()

    def watch(self, interval_s: float) -> None:
        self.intervals.append(interval_s)


def test_the_first_watcher_turns_snapshots_on_and_the_last_off() -> None:
    engine = _Watched()
    watchers = Watchers(engine)  # type: ignore[arg-type]
    watchers.join()
    watchers.join()
    watchers.leave()
    assert engine.intervals == [0.2]
    watchers.leave()
    assert engine.intervals == [0.2, 0.0] and engine.snapshot is None


def test_the_engine_snapshots_at_the_shortest_interval_asked() -> None:
    engine = _Watched()
    watchers = Watchers(engine)  # type: ignore[arg-type]
    watchers.join(5.0)
    watchers.join(1.0)
    watchers.join(5.0)
    watchers.leave(1.0)
    watchers.leave(5.0)
    assert engine.intervals == [5.0, 1.0, 5.0]
    watchers.leave(5.0)
    assert engine.intervals == [5.0, 1.0, 5.0, 0.0] and engine.snapshot is None


def test_histogram_quantiles_as_prometheus_estimates_them() -> None:
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (5 - 2) / 4)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (9.9 - 6) / 4)
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 4.0)]) == 0.1  # past the last bound
