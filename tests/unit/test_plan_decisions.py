"""`pagoda plan`'s decisions on given sweep summaries (pagoda/bench/plan.py): which runs are
inside the SLOs, the batch size and rate it picks, cost per 1K tokens and replicas."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from pagoda.bench import plan as plan_module
from pagoda.bench.plan import (
    cost_per_1k_tokens,
    largest_within,
    next_rate,
    planned_slo,
    prompts_for_rate,
    replicas_for,
    server_at,
    within_slo,
)


def run(rate: float, ttft: float, tpot: float | None, failed: int = 0, **kw: Any) -> dict[str, Any]:
    return {
        "request_rate": rate,
        "p99_ttft_ms": ttft,
        "p99_tpot_ms": tpot,
        "failed": failed,
        "completed": 10,
        **kw,
    }


def test_within_slo() -> None:
    assert within_slo(run(1, 100, 10), 200, 20)
    assert not within_slo(run(1, 300, 10), 200, 20)  # TTFT over
    assert not within_slo(run(1, 100, 30), 200, 20)  # TPOT over
    assert not within_slo(run(1, 100, 10, failed=1), 200, 20)  # a failed request
    assert within_slo(run(1, 100, None), 200, 20)  # one output token each: no TPOT
    assert within_slo(run(1, 9999, 10), None, 20)  # the batch sweep ignores TTFT
    assert not within_slo({**run(1, 100, 10), "completed": 0}, 200, 20)


def test_the_largest_rate_and_batch_within_the_slos() -> None:
    rates = [run(1, 50, 8), run(2, 90, 12), run(3, 250, 15), run(4, 900, 40)]
    best = largest_within(rates, "request_rate", 200, 20)
    assert best is not None and best["request_rate"] == 2
    assert largest_within(rates, "request_rate", 10, 20) is None
    batches = [
        run(0, 0, 8, max_concurrency=1),
        run(0, 0, 14, max_concurrency=4),
        run(0, 0, 25, max_concurrency=16),
    ]
    chosen = largest_within(batches, "max_concurrency", None, 20)
    assert chosen is not None and chosen["max_concurrency"] == 4


def test_a_pass_above_a_miss_is_not_capacity() -> None:
    # 3 req/s passed by luck after 2 req/s missed: the plan stops at the first miss.
    rates = [run(3, 150, 15), run(1, 50, 8), run(2, 250, 12), run(4, 100, 10)]
    best = largest_within(rates, "request_rate", 200, 20)
    assert best is not None and best["request_rate"] == 1


def test_the_sweep_goes_on_while_its_top_rate_passes() -> None:
    slo = (200.0, 20.0)
    assert next_rate([run(1, 50, 8), run(2, 90, 12)], slo) == 2.5
    assert next_rate([run(2, 90, 12), run(1, 50, 8)], slo) == 2.5  # the top, not the last
    assert next_rate([run(1, 50, 8), run(2, 250, 12)], slo) is None
    assert next_rate([run(1, 50, 8), run(2, 90, 12, failed=1)], slo) is None


def test_the_choices_keep_a_margin_inside_the_slos() -> None:
    planned = planned_slo((1000.0, 100.0), 0.1)
    assert planned == pytest.approx((900.0, 90.0))
    runs = [run(1, 500, 50), run(2, 950, 60), run(3, 990, 99)]  # all inside the SLOs
    best = largest_within(runs, "request_rate", *planned)
    assert best is not None and best["request_rate"] == 1  # 950 ms is within 5% of 1000 ms
    assert planned_slo((1000.0, 100.0), 0.0) == (1000.0, 100.0)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="slo-margin"):
            planned_slo((1000.0, 100.0), bad)


def test_requests_per_rate_run() -> None:
    assert prompts_for_rate(64, 1.0, 30.0) == 64  # --num-prompts is the floor
    assert prompts_for_rate(64, 3.2, 30.0) == 96
    assert prompts_for_rate(4, 2.5, 1.0) == 4
    assert prompts_for_rate(4, 8.0, 1.0) == 8


def test_the_rate_phase_server_runs_the_chosen_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []

    @contextlib.contextmanager
    def fake(args: list[str]) -> Iterator[Any]:
        started.append(args)
        yield argparse.Namespace(url=f"http://s{len(started)}", pid=0)

    monkeypatch.setattr(plan_module, "started_server", fake)
    at = server_at(argparse.Namespace(serve_args="m --dtype float32", base_url=None))
    with at(None) as url:
        assert url == "http://s1"
    with at(4) as url:
        assert url == "http://s2"
    assert started == [
        ["m", "--dtype", "float32"],
        ["m", "--dtype", "float32", "--max-num-seqs", "4"],
    ]
    running = server_at(argparse.Namespace(serve_args=None, base_url="http://there"))
    with running(4) as url:
        assert url == "http://there"  # a running server is not restarted
    assert len(started) == 2


def test_cost_and_replicas() -> None:
    # $3.60 an hour at 1000 output tokens/s: $0.001 per 1K tokens.
    assert cost_per_1k_tokens(3.6, 1000.0) == pytest.approx(0.001)
    assert cost_per_1k_tokens(1.0, 50.0) == pytest.approx(1.0 / 3600 / 50 * 1000)
    assert replicas_for(10.0, 2.5) == 4
    assert replicas_for(10.0, 3.0) == 4
    assert replicas_for(0.5, 3.0) == 1
    with pytest.raises(ValueError):
        cost_per_1k_tokens(1.0, 0.0)
    with pytest.raises(ValueError):
        replicas_for(1.0, 0.0)
