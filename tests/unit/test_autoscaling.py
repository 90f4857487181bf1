"""The rollout autoscaler: a pure function of the spec, the last status and the time."""

from datetime import UTC, datetime, timedelta

import pytest
from grpo_operator.api.roles import RolloutSpec
from grpo_operator.api.status import GRPOJobStatus, Progress, ReplicaStatus, RolloutScalingStatus
from grpo_operator.controller.autoscaling import STALE_REPORT_S, rollout_replicas

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SCALING = {"targetWaitFraction": 0.1, "scaleDownBelow": 0.02, "scaleUpCooldownSeconds": 60,
           "scaleDownCooldownSeconds": 300}  # fmt: skip


def spec(replicas=2, lo=1, hi=8, **scaling) -> RolloutSpec:
    return RolloutSpec.model_validate(
        {"replicas": replicas, "minReplicas": lo, "maxReplicas": hi, "autoscaling": {**SCALING, **scaling}}
    )


def status(current: int | None, wait: float | None, *, report_age=10.0, last_scale_age=None) -> GRPOJobStatus:
    st = GRPOJobStatus()
    if current is not None:
        st.rollout = ReplicaStatus(replicas=current)
        last = None if last_scale_age is None else (NOW - timedelta(seconds=last_scale_age)).isoformat()
        st.rollout_scaling = RolloutScalingStatus(last_scale_time=last, reason="Started")
    stamp = (NOW - timedelta(seconds=report_age)).isoformat(timespec="seconds")
    st.progress = Progress(step=5, rollout_wait_fraction=wait, updated_at=stamp)
    return st


@pytest.mark.parametrize(
    ("what", "current", "wait", "kw", "expected", "reason"),
    [
        ("first pass starts at spec.replicas", None, None, {}, 2, None),
        ("a waiting trainer gets servers in proportion", 2, 0.25, {}, 4, "TrainerWaiting"),
        ("at most double per move", 2, 0.9, {}, 4, "TrainerWaiting"),
        ("at least one more", 4, 0.11, {}, 5, "TrainerWaiting"),
        ("never above maxReplicas", 7, 0.9, {}, 8, "TrainerWaiting"),
        ("at maxReplicas it stays", 8, 0.9, {}, 8, None),
        ("inside the band nothing moves", 4, 0.05, {"last_scale_age": 10_000}, 4, None),
        ("idle rollouts lose one server", 4, 0.0, {"last_scale_age": 301}, 3, "RolloutsIdle"),
        ("not before the down cooldown", 4, 0.0, {"last_scale_age": 120}, 4, None),
        ("not before the up cooldown", 4, 0.5, {"last_scale_age": 30}, 4, None),
        ("never below minReplicas", 1, 0.0, {"last_scale_age": 10_000}, 1, None),
        ("a stale report moves nothing", 4, 0.9, {"report_age": STALE_REPORT_S + 1}, 4, None),
        ("no report yet moves nothing", 4, None, {}, 4, None),
        ("bounds edited below the count", 12, 0.05, {}, 8, "OutOfBounds"),
    ],
)
def test_rollout_replicas(what, current, wait, kw, expected, reason) -> None:
    move = rollout_replicas(spec(), status(current, wait, **kw), NOW)
    assert (move.replicas, move.reason) == (expected, reason), what


def test_without_autoscaling_the_spec_decides() -> None:
    plain = RolloutSpec.model_validate({"replicas": 3})
    assert rollout_replicas(plain, status(7, 0.9), NOW).replicas == 3


def test_moves_say_why_with_the_numbers() -> None:
    move = rollout_replicas(spec(), status(2, 0.25), NOW)
    assert move.message == "trainer waits 25% of its time for rollouts (target 10%): 2 → 4"
