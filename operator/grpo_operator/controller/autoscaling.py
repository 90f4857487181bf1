"""Rollout capacity that follows the trainer: the count of rollout servers as a pure function.

Called by `controller.status.decide` every pass. Without `spec.rollout.autoscaling` the count is
`spec.rollout.replicas` (what `kubectl scale`, an HPA or KEDA set). With it, the operator owns
the count and keeps it in `status.rollout.replicas`, never in spec (GitOps sees no drift): it
adds servers while trainer rank 0 reports that it waits for generations more than the target
share of its time (`status.progress.rolloutWaitFraction`), and removes one at a time while the
wait stays under the low mark, each move after its cooldown. The gap between the two marks is the
hysteresis that keeps the count from flapping. A report older than STALE_REPORT_S moves nothing:
a trainer that stopped reporting is no signal.
"""

import math
from dataclasses import dataclass
from datetime import datetime

from grpo_operator.api.roles import RolloutSpec
from grpo_operator.api.status import GRPOJobStatus

STALE_REPORT_S = 300.0
MAX_STEP_FACTOR = 2  # a scale-up at most doubles the fleet, as an HPA's default policy does


@dataclass(frozen=True)
class Move:
    """The rollout count for this pass; `reason` is set when it changed."""

    replicas: int
    reason: str | None = None
    message: str = ""


def _age(stamp: str | None, now: datetime) -> float:
    if not stamp:
        return math.inf
    try:
        then = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return math.inf
    return (now - then).total_seconds()


def rollout_replicas(spec: RolloutSpec, old: GRPOJobStatus, now: datetime) -> Move:
    """The rollout servers to run now, given the last status the operator wrote."""
    scaling = spec.autoscaling
    if scaling is None:
        return Move(spec.replicas)
    lo, hi = spec.min_replicas or 1, spec.max_replicas or spec.replicas
    owned = old.rollout_scaling is not None and old.rollout is not None
    current = old.rollout.replicas if owned and old.rollout else spec.replicas
    if not lo <= current <= hi:
        bounded = min(max(current, lo), hi)
        return Move(bounded, "OutOfBounds", f"{current} → {bounded}: rollout bounds are [{lo}, {hi}]")
    progress = old.progress
    wait = progress.rollout_wait_fraction if progress is not None else None
    if wait is None or _age(progress.updated_at if progress else None, now) > STALE_REPORT_S:
        return Move(current)
    since = _age(old.rollout_scaling.last_scale_time if old.rollout_scaling else None, now)
    target = scaling.target_wait_fraction
    if wait > target and current < hi and since >= scaling.scale_up_cooldown_seconds:
        wanted = math.ceil(current * wait / target)  # the count at which the wait would meet the target
        new = min(hi, MAX_STEP_FACTOR * current, max(current + 1, wanted))
        text = f"trainer waits {wait:.0%} of its time for rollouts (target {target:.0%}): {current} → {new}"
        return Move(new, "TrainerWaiting", text)
    low = scaling.scale_down_below
    if wait < low and current > lo and since >= scaling.scale_down_cooldown_seconds:
        text = (
            f"trainer waits {wait:.0%} of its time for rollouts (under {low:.0%}): {current} → {current - 1}"
        )
        return Move(current - 1, "RolloutsIdle", text)
    return Move(current)
