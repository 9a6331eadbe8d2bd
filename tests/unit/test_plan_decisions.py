"""`pagoda plan`'s decisions on given sweep summaries (pagoda/bench/plan.py): which runs are
inside the SLOs, the batch size and rate it picks, cost per 1K tokens and replicas."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.bench.plan import (
    cost_per_1k_tokens,
    largest_within,
    replicas_for,
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
