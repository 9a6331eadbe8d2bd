"""The SLO autoscaling policy (pagoda/scaleout/autoscaling.py) driven with synthetic metrics:
every decision of a load ramp is asserted, with Ray Serve's AutoscalingContext field names."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pagoda.scaleout.autoscaling import (
    SLOAutoscalingPolicy,
    SLOPolicyConfig,
    SLOSnapshot,
    SLOWindow,
    decide,
    decision,
    snapshot_of,
)

CONFIG = SLOPolicyConfig(
    ttft_slo_s=1.0,
    tpot_slo_s=0.1,
    up_violation_rate=0.05,
    down_violation_rate=0.01,
    up_queue_depth=2.0,
    down_queue_depth=0.0,
)
CALM = SLOSnapshot(0.0, 0.0, 0.0)
LATE_TTFT = SLOSnapshot(0.2, 0.0, 0.0)
LATE_TPOT = SLOSnapshot(0.0, 0.08, 0.0)
QUEUED = SLOSnapshot(0.0, 0.0, 3.0)
BETWEEN = SLOSnapshot(0.03, 0.0, 0.0)  # above the down threshold, below the up one


def test_each_period_s_decision() -> None:
    assert [decision(s, CONFIG) for s in (LATE_TTFT, LATE_TPOT, QUEUED)] == ["up"] * 3
    assert decision(CALM, CONFIG) == "down"
    assert decision(BETWEEN, CONFIG) == "hold"
    assert decision(SLOSnapshot(0.0, 0.0, 1.0), CONFIG) == "hold"  # a queue, under the up bound
    assert decision(None, CONFIG) == "hold"  # no replica has reported yet


def test_a_load_ramp_scales_up_then_back_down_to_the_warm_minimum() -> None:
    """min 1, max 3: each period wishes one replica more than Ray's target on a violation or a
    queue, one fewer when calm, the same in between; never past the bounds (Ray's delays, not
    the policy, decide how long a wish must last)."""
    periods = [
        (LATE_TTFT, 1, 2),
        (QUEUED, 2, 3),
        (LATE_TPOT, 3, 3),  # at the maximum
        (BETWEEN, 3, 3),  # hold
        (CALM, 3, 2),
        (CALM, 2, 1),
        (CALM, 1, 1),  # the warm minimum stays
        (None, 2, 2),  # nothing reported yet: hold
    ]
    for target, (snapshot, current, want) in enumerate(periods):
        assert decide(snapshot, current, 1, 3, CONFIG) == want, (target, snapshot)


def test_ray_serve_context() -> None:
    """policy_function's contract: Ray builds the class with policy_kwargs, then calls it with
    its AutoscalingContext for (replicas, policy state); aggregated_metrics is {metric: {replica:
    value}}, averaged over the replicas."""
    policy = SLOAutoscalingPolicy(ttft_slo_s=1.0, tpot_slo_s=0.1, up_violation_rate=0.05)
    assert policy.config == SLOPolicyConfig(ttft_slo_s=1.0, tpot_slo_s=0.1)
    metrics = {
        "ttft_violations": {"r1": 0.0, "r2": 0.3},  # mean 0.15 > 0.05
        "tpot_violations": {"r1": 0.0, "r2": 0.0},
        "queue_depth": {"r1": 0.0, "r2": 1.0},
    }

    def ctx(target: int, aggregated: Any = metrics) -> Any:
        return SimpleNamespace(
            current_num_replicas=1,
            target_num_replicas=target,
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=4,
            aggregated_metrics=aggregated,
            policy_state={},
        )

    assert policy(ctx(2)) == (3, {"decision": "up"})  # from the target, not the running count
    assert snapshot_of(metrics) == SLOSnapshot(0.15, 0.0, 0.5)
    assert snapshot_of({"ttft_violations": {"r1": 0.0}}) is None  # a metric missing: hold
    assert policy(ctx(2, aggregated={})) == (2, {"decision": "hold"})
    with pytest.raises(TypeError):
        SLOAutoscalingPolicy(ttft_slo=1.0)  # a misspelt kwarg is refused, not ignored


def test_a_replica_s_window_reports_and_restarts() -> None:
    window = SLOWindow(CONFIG)
    assert window.report(queue_depth=0) == {
        "ttft_violations": 0.0,
        "tpot_violations": 0.0,
        "queue_depth": 0.0,
    }
    window.record(ttft_s=0.5, tpot_s=0.05)
    window.record(ttft_s=1.5, tpot_s=0.05)  # TTFT over its SLO
    window.record(ttft_s=0.2, tpot_s=0.2)  # TPOT over its SLO
    window.record(ttft_s=2.0, tpot_s=None)  # one output token: no TPOT
    assert window.report(queue_depth=3) == {
        "ttft_violations": 0.5,
        "tpot_violations": 0.25,
        "queue_depth": 3.0,
    }
    assert window.report(queue_depth=0)["ttft_violations"] == 0.0  # a new window


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ttft_slo_s": 0}, "must be > 0"),
        ({"down_violation_rate": 0.1, "up_violation_rate": 0.05}, "violation rates"),
        ({"down_queue_depth": 3.0, "up_queue_depth": 2.0}, "queue depths"),
    ],
)
def test_bad_config_is_a_value_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SLOPolicyConfig(**kwargs)
