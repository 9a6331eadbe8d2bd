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

and asks for one replica more or fewer than Ray's current target, within [min_replicas,
max_replicas]. Ray moves the target only once a wish has lasted upscale_delay_s (or
downscale_delay_s) of wall-clock time: that is the hysteresis. min_replicas stay warm: an engine
takes seconds to start, so capacity that must answer at once is never scaled away.
"""

from __future__ import annotations

from collections.abc import Mapping
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

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("ttft_slo_s and tpot_slo_s must be > 0")
        if not 0 <= self.down_violation_rate < self.up_violation_rate <= 1:
            raise ValueError(
                "violation rates need 0 <= down_violation_rate < up_violation_rate <= 1"
            )
        if not 0 <= self.down_queue_depth < self.up_queue_depth:
            raise ValueError("queue depths need 0 <= down_queue_depth < up_queue_depth")


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
    target: int,
    min_replicas: int,
    max_replicas: int,
    config: SLOPolicyConfig,
) -> int:
    """The replica count to wish for, one step from Ray's current target."""
    step = {"up": 1, "down": -1, "hold": 0}[decision(snapshot, config)]
    return max(min_replicas, min(max_replicas, target + step))


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


class SLOAutoscalingPolicy:
    """Ray Serve's policy_function (`AutoscalingPolicy(policy_function=
    "pagoda.scaleout.autoscaling:SLOAutoscalingPolicy", policy_kwargs={...})`): Ray builds
    it once with policy_kwargs (SLOPolicyConfig's fields), then calls it every control period
    with its AutoscalingContext (target_num_replicas, capacity_adjusted_min_replicas / _max_
    replicas, aggregated_metrics) for (replicas, policy state)."""

    def __init__(self, **policy_kwargs: float) -> None:
        self.config = SLOPolicyConfig(**policy_kwargs)  # type: ignore[arg-type]

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        snapshot = snapshot_of(ctx.aggregated_metrics)
        wish = decide(
            snapshot,
            ctx.target_num_replicas,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
            self.config,
        )
        return wish, {"decision": decision(snapshot, self.config)}


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
