"""Autoscaling on the SLO, not on average load: a Ray Serve custom autoscaling policy (Ray's
`AutoscalingPolicy(policy_function=...)`, called with its `AutoscalingContext` every control
period) and the window each replica reports it from. Nothing here imports ray.

Each replica reports, every metrics interval (Ray Serve's `record_autoscaling_stats`), over the
requests it finished since its previous report (SLOWindow):

    ttft_violations   the fraction whose time to first token exceeded the TTFT SLO
    tpot_violations   the fraction whose mean time per output token exceeded the TPOT SLO
    queue_depth       requests waiting for the engine (admitted, not running yet)

Ray averages each over its look-back window, per replica; the policy reads the mean over the
replicas. Each control period it decides:

    up     a violation rate above up_violation_rate, or a queue deeper than up_queue_depth
    down   both violation rates at most down_violation_rate and the queue at most
           down_queue_depth
    hold   otherwise, or while no replica has reported

A decision must repeat for up_periods (down_periods) periods in a row before the replica count
moves, by one replica, within [min_replicas, max_replicas]; a different decision restarts the
count. min_replicas stay warm: an engine takes seconds to start, so capacity that must answer
at once is never scaled away.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

METRICS = ("ttft_violations", "tpot_violations", "queue_depth")


@dataclass(frozen=True)
class SLOPolicyConfig:
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    up_violation_rate: float = 0.05
    down_violation_rate: float = 0.01
    up_queue_depth: float = 2.0
    down_queue_depth: float = 0.0
    up_periods: int = 2
    down_periods: int = 5

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("ttft_slo_s and tpot_slo_s must be > 0")
        if not 0 <= self.down_violation_rate < self.up_violation_rate <= 1:
            raise ValueError(
                "violation rates need 0 <= down_violation_rate < up_violation_rate <= 1"
            )
        if not 0 <= self.down_queue_depth < self.up_queue_depth:
            raise ValueError("queue depths need 0 <= down_queue_depth < up_queue_depth")
        if self.up_periods < 1 or self.down_periods < 1:
            raise ValueError("up_periods and down_periods must be >= 1")


@dataclass(frozen=True)
class SLOSnapshot:
    """The replicas' mean of each reported metric over Ray's look-back window."""

    ttft_violations: float
    tpot_violations: float
    queue_depth: float


def decision(snapshot: SLOSnapshot | None, config: SLOPolicyConfig) -> str:
    """ "up", "down" or "hold" for one control period (see the module's text)."""
    if snapshot is None:
        return "hold"
    worst = max(snapshot.ttft_violations, snapshot.tpot_violations)
    if worst > config.up_violation_rate or snapshot.queue_depth > config.up_queue_depth:
        return "up"
    if worst <= config.down_violation_rate and snapshot.queue_depth <= config.down_queue_depth:
        return "down"
    return "hold"


def decide(
    snapshot: SLOSnapshot | None,
    current: int,
    min_replicas: int,
    max_replicas: int,
    state: Mapping[str, Any],
    config: SLOPolicyConfig,
) -> tuple[int, dict[str, Any]]:
    """The replica count to run and the policy's state for the next period. state holds the
    last decision and how many periods in a row it was made."""
    made = decision(snapshot, config)
    streak = state.get("streak", 0) + 1 if state.get("decision") == made else 1
    target = current
    if made == "up" and streak >= config.up_periods:
        target, streak = current + 1, 0
    elif made == "down" and streak >= config.down_periods:
        target, streak = current - 1, 0
    target = max(min_replicas, min(max_replicas, target))
    return target, {"decision": made, "streak": streak}


def snapshot_of(aggregated: Mapping[str, Mapping[Any, float]] | None) -> SLOSnapshot | None:
    """The replicas' means from Ray's aggregated_metrics ({metric: {replica id: value}}); None
    until every metric has a value from some replica."""
    if not aggregated:
        return None
    means = []
    for name in METRICS:
        values = list(aggregated.get(name, {}).values())
        if not values:
            return None
        means.append(sum(values) / len(values))
    return SLOSnapshot(*means)


def slo_autoscaling_policy(
    config: SLOPolicyConfig,
) -> Callable[[Any], tuple[int, dict[str, Any]]]:
    """A policy_function for Ray Serve's AutoscalingPolicy: called with its AutoscalingContext
    (current_num_replicas, capacity_adjusted_min_replicas / _max_replicas, aggregated_metrics,
    policy_state), it returns (replicas, policy state)."""

    def policy(ctx: Any) -> tuple[int, dict[str, Any]]:
        return decide(
            snapshot_of(ctx.aggregated_metrics),
            ctx.current_num_replicas,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
            ctx.policy_state or {},
            config,
        )

    return policy


class SLOWindow:
    """A replica's finished requests since its last report (see the module's text)."""

    def __init__(self, config: SLOPolicyConfig) -> None:
        self.config = config
        self.finished = 0
        self.ttft_late = 0
        self.tpot_late = 0

    def record(self, ttft_s: float, tpot_s: float | None) -> None:
        """A finished request: its time to first token, and its mean time per output token
        (None with a single output token)."""
        self.finished += 1
        self.ttft_late += ttft_s > self.config.ttft_slo_s
        self.tpot_late += tpot_s is not None and tpot_s > self.config.tpot_slo_s

    def report(self, queue_depth: int) -> dict[str, float]:
        """The metrics since the last report (0 violations when nothing finished), then a new
        window."""
        finished = max(self.finished, 1)
        stats = {
            "ttft_violations": self.ttft_late / finished,
            "tpot_violations": self.tpot_late / finished,
            "queue_depth": float(queue_depth),
        }
        self.finished = self.ttft_late = self.tpot_late = 0
        return stats
