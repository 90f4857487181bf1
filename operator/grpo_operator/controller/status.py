"""The lifecycle as a pure function: (spec, old status, what the pods say, now) → decision.

Called by `controller.reconcile` once per pass. Like Kubeflow Trainer's controller it
snapshots the old status, computes conditions with small helpers and lets the caller patch
only when something changed; all timing (deadline, TTL) is computed here from `now`, so the
whole lifecycle is unit-tested without a cluster.
"""

from dataclasses import dataclass, field
from datetime import UTC, datetime

from grpo_operator.api.contract import EXIT_CONFIG
from grpo_operator.api.roles import resolve_all2all
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import (
    TERMINAL_PHASES,
    TRAINER_STATED,
    Condition,
    ConditionType,
    GRPOJobStatus,
    Phase,
    Reason,
    ReplicaStatus,
    RolloutScalingStatus,
)
from grpo_operator.controller import autoscaling
from grpo_operator.controller.admission import Admission
from grpo_operator.controller.observe import Observation
from grpo_operator.lifecycle import GangDecision, Outcome, Verdict, VerdictKind, gang_decision, seconds_left
from grpo_operator.render import names

WARNING_REASONS = {
    Reason.ESCALATION_REFUSED,
    Reason.TRAINER_FAILED,
    Reason.NODE_LOST,
    Reason.BACKOFF_LIMIT_EXCEEDED,
    Reason.PERMANENT_ERROR,
    Reason.INVALID_SPEC,
    Reason.DEADLINE_EXCEEDED,
    *TRAINER_STATED,
}


@dataclass(frozen=True)
class SpecError:
    """Why the job's current spec cannot run: it does not parse or render, or it asks for
    escalations nobody approved."""

    reason: Reason
    message: str


@dataclass
class Decision:
    """What the reconcile should make true; `events` are (type, reason, message)."""

    status: GRPOJobStatus
    running: bool
    gang_restart: bool = False
    delete_job: bool = False
    requeue_after: float | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)


def timestamp(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC) if text else None


def set_condition(
    status: GRPOJobStatus, ctype: str, value: bool, reason: str, message: str, now: datetime
) -> None:
    """Upsert a condition; lastTransitionTime moves only when its status flips."""
    text = "True" if value else "False"
    for i, c in enumerate(status.conditions):
        if c.type == ctype:
            when = c.last_transition_time if c.status == text else timestamp(now)
            status.conditions[i] = Condition(
                type=ctype, status=text, reason=reason, message=message, last_transition_time=when
            )
            return
    status.conditions.append(
        Condition(
            type=ctype, status=text, reason=reason, message=message, last_transition_time=timestamp(now)
        )
    )


def _clear(status: GRPOJobStatus, ctype: str, reason: str, message: str, now: datetime) -> None:
    """Set a condition False only if it was ever set (keeps the list short)."""
    if any(c.type == ctype for c in status.conditions):
        set_condition(status, ctype, False, reason, message, now)


def _finish(status: GRPOJobStatus, phase: Phase, reason: str, message: str, now: datetime) -> None:
    status.phase = phase
    status.message = message
    status.completion_time = timestamp(now)
    ctype = ConditionType.SUCCEEDED if phase == Phase.SUCCEEDED else ConditionType.FAILED
    set_condition(status, ctype, True, reason, message, now)
    set_condition(status, ConditionType.RUNNING, False, reason, message, now)
    _clear(status, ConditionType.RESTARTING, reason, message, now)


def _replicas(spec: GRPOJobSpec, obs: Observation) -> tuple[ReplicaStatus, ReplicaStatus]:
    t, r = spec.trainer.replicas, spec.rollout.replicas
    return (
        ReplicaStatus(replicas=t, ready=obs.trainer.ready, ready_text=f"{obs.trainer.ready}/{t}"),
        ReplicaStatus(replicas=r, ready=obs.rollout.ready, ready_text=f"{obs.rollout.ready}/{r}"),
    )


def _reward_replicas(spec: GRPOJobSpec, obs: Observation) -> ReplicaStatus | None:
    """The reward model servers' readiness; None for a job without spec.reward.model."""
    if spec.reward.model is None:
        return None
    n = spec.reward.model.replicas
    return ReplicaStatus(replicas=n, ready=obs.reward.ready, ready_text=f"{obs.reward.ready}/{n}")


def decide(
    *,
    spec: GRPOJobSpec | None,
    generation: int,
    old: GRPOJobStatus,
    obs: Observation,
    now: datetime,
    spec_error: SpecError | None = None,
    queue: Admission | None = None,
) -> Decision:
    """The next status and actions. `spec` is what runs: None when the job has nothing it can
    run (`spec_error` says why; the job fails), or the last spec that ran when a live edit was
    refused (`spec_error` set: the job runs on and says so). `queue` is set for a job Kueue
    admits (it runs only while admitted)."""
    status = old.model_copy(deep=True)
    status.observed_generation = generation
    if old.phase in TERMINAL_PHASES:
        return _terminal(spec, status, now)
    if spec is None:
        error = spec_error or SpecError(Reason.INVALID_SPEC, "invalid spec")
        _finish(status, Phase.FAILED, error.reason, error.message, now)
        return _with_events(old, Decision(status=status, running=False))
    events = _update_verdict(status, generation, spec_error, now)
    decision = _decide_running(spec, old, status, obs, now, queue)
    decision.events[:0] = events
    decision.events += _autoscale(spec, old, decision.status, now)
    decision.events += _placement(old, decision.status, obs, now)
    return decision


def _placement(old: GRPOJobStatus, status: GRPOJobStatus, obs: Observation, now: datetime) -> list:
    """PlacementDegraded (and one Warning Event) once a rollout group's pod shows the API server
    dropped its group affinity; the condition stays: the pods keep the spec they were made with."""
    if not obs.affinity_dropped:
        return []
    msg = (
        f"pod {obs.affinity_dropped}: the API server dropped matchLabelKeys from the rollout group's pod "
        "affinity (Kubernetes before 1.31, or MatchLabelKeysInPodAffinity off), so a group's pods are "
        "kept in one zone and under few network spines together with every other group's instead of "
        "their own: upgrade the cluster to 1.31 or later for per-group placement"
    )
    was = next((c for c in old.conditions if c.type == ConditionType.PLACEMENT_DEGRADED), None)
    set_condition(status, ConditionType.PLACEMENT_DEGRADED, True, Reason.GROUP_AFFINITY_DROPPED, msg, now)
    if was is not None and was.status == "True":
        return []
    return [("Warning", str(Reason.GROUP_AFFINITY_DROPPED), msg)]


def _autoscale(spec: GRPOJobSpec, old: GRPOJobStatus, status: GRPOJobStatus, now: datetime) -> list:
    """The rollout count `autoscaling` decides, in status (never spec), with an Event per move."""
    if spec.rollout.autoscaling is None:
        status.rollout_scaling = None
        return []
    move = autoscaling.rollout_replicas(spec.rollout, old, now)
    ready = status.rollout.ready if status.rollout else 0
    status.rollout = ReplicaStatus(replicas=move.replicas, ready=ready, ready_text=f"{ready}/{move.replicas}")
    if move.reason is None:
        status.rollout_scaling = old.rollout_scaling or RolloutScalingStatus(
            reason="Started", message=f"starting at rollout.replicas = {move.replicas}"
        )
        return []
    status.rollout_scaling = RolloutScalingStatus(
        last_scale_time=timestamp(now), reason=move.reason, message=move.message
    )
    return [("Normal", move.reason, f"rollout servers {move.message}")]


def _decide_running(
    spec: GRPOJobSpec,
    old: GRPOJobStatus,
    status: GRPOJobStatus,
    obs: Observation,
    now: datetime,
    queue: Admission | None,
) -> Decision:
    """Suspended, queued, past its deadline, finished, failed, restarting or progressing."""
    status.trainer, status.rollout = _replicas(spec, obs)
    status.reward = _reward_replicas(spec, obs)
    status.rollout_all2all_backend = resolve_all2all(spec.rollout)
    if spec.run_policy.suspend:
        return _suspended(old, status, now)
    if queue is not None and not queue.runs:
        return _queued(old, status, now, queue)
    if old.phase == Phase.SUSPENDED:
        set_condition(status, ConditionType.SUSPENDED, False, Reason.RESUMED, "job resumed", now)
    status.start_time = status.start_time or timestamp(now)
    decision = Decision(status=status, running=True)
    deadline = spec.run_policy.active_deadline_seconds
    remaining = seconds_left((now - parse_time(status.start_time)).total_seconds(), deadline)
    if remaining is not None and remaining <= 0:
        msg = f"job ran past activeDeadlineSeconds={deadline}"
        _finish(status, Phase.FAILED, Reason.DEADLINE_EXCEEDED, msg, now)
        return _with_events(old, Decision(status=status, running=False))
    decision.requeue_after = remaining
    if (bad := _server_misconfigured(obs)) is not None:
        reason = bad.stated_reason or Reason.REWARD_MODEL_MISCONFIGURED  # e.g. PathNotFound
        stated = bad.reason.split(f"{reason}: ", 1)[-1]
        what = "reward model server" if bad.role == names.ROLE_REWARD else "rollout server pod"
        msg = f"{what} {bad.pod} cannot serve as configured: {stated}"
        _finish(status, Phase.FAILED, reason, msg, now)
        return _with_events(old, Decision(status=status, running=False))
    verdicts = [v for v in obs.verdicts if v.role == names.ROLE_TRAINER and v.attempt == old.restarts]
    gang = gang_decision(verdicts, restarts=old.restarts, backoff_limit=spec.run_policy.backoff_limit)
    if gang.outcome == Outcome.RUN:
        _progress_phase(spec, old, status, obs, now)
    elif gang.outcome == Outcome.SUCCEED:
        _finish(status, Phase.SUCCEEDED, Reason.COMPLETED, "trainer rank 0 exited 0 after its last step", now)
        decision.running = False
    else:
        _on_failure(spec, status, gang, now, decision)
    return _with_events(old, decision)


def is_server_misconfiguration(v: Verdict) -> bool:
    """A server pod that exited EXIT_CONFIG: no restart fixes what it found, so the job fails at once
    with the reason and words the pod stated. A reward model server: its model cannot score as
    configured (no model at spec.reward.model.path, a classifier with several outputs, a head width
    its engine lacks), which the rollout servers would only report as unreachable. A rollout server
    pod (leader or worker): only with a stated reason (`EPBackendUnavailable: ...`, `EFAMisconfigured:
    ...`: what its node or image lacks for the layout the job resolved), otherwise its StatefulSet or
    LeaderWorkerSet replaces it as before."""
    if v.kind != VerdictKind.FAILED or v.exit_code != EXIT_CONFIG:
        return False
    return v.role == names.ROLE_REWARD or (v.role == names.ROLE_ROLLOUT and v.stated_reason is not None)


def _server_misconfigured(obs: Observation) -> Verdict | None:
    return next((v for v in obs.verdicts if is_server_misconfiguration(v)), None)


def _update_verdict(
    status: GRPOJobStatus, generation: int, error: SpecError | None, now: datetime
) -> list[tuple[str, str, str]]:
    """UpdateRejected while a live edit cannot run (one Warning Event per refusal), cleared once
    a valid spec is back."""
    if error is None:
        _clear(status, ConditionType.UPDATE_REJECTED, Reason.SPEC_ACCEPTED, "the spec is valid", now)
        return []
    text = f"generation {generation} not applied, the job runs on as before: {error.message}"
    seen = next((c for c in status.conditions if c.type == ConditionType.UPDATE_REJECTED), None)
    set_condition(status, ConditionType.UPDATE_REJECTED, True, error.reason, text, now)
    if seen is not None and seen.status == "True" and seen.message == text:
        return []
    return [("Warning", str(error.reason), text)]


def rejected_update(old: GRPOJobStatus, generation: int, error: SpecError, now: datetime) -> Decision:
    """A refused live edit when the spec that ran is not known (the operator restarted since):
    change nothing, only say why. Lifecycle decisions resume with the next valid spec."""
    status = old.model_copy(deep=True)
    status.observed_generation = generation
    events = _update_verdict(status, generation, error, now)
    return Decision(status=status, running=True, events=events)


def recovered(status: GRPOJobStatus, now: datetime) -> None:
    """A pass succeeded: a ReconcileError of an earlier pass no longer holds."""
    _clear(status, ConditionType.RECONCILE_ERROR, Reason.RECOVERED, "the last pass succeeded", now)


def failed_pass(status: GRPOJobStatus, reason: str, message: str, now: datetime) -> None:
    """A pass raised: say so in the status (the operator retries with backoff)."""
    set_condition(status, ConditionType.RECONCILE_ERROR, True, reason, message, now)
    status.message = f"reconcile failed, retrying: {message}"


def _on_failure(
    spec: GRPOJobSpec, status: GRPOJobStatus, gang: GangDecision, now: datetime, decision: Decision
) -> None:
    """Fail the job, or record the next attempt of the gang (the policy is `lifecycle`'s)."""
    assert gang.culprit is not None and gang.reason is not None
    what, limit = _where(spec, status, gang.culprit), spec.run_policy.backoff_limit
    if gang.outcome == Outcome.FAIL:
        msg = (
            f"{what}: a permanent error"
            if gang.permanent
            else f"{what}; {status.restarts} gang restarts reached backoffLimit={limit}"
        )
        _finish(status, Phase.FAILED, gang.reason, msg, now)
        decision.running = False
        return
    status.restarts += 1
    status.phase = Phase.RESTARTING
    status.message = f"{what}; restarting all trainer pods (restart {status.restarts} of {limit})"
    set_condition(status, ConditionType.RESTARTING, True, gang.reason, status.message, now)
    set_condition(status, ConditionType.RUNNING, False, gang.reason, status.message, now)
    status.trainer = ReplicaStatus(
        replicas=spec.trainer.replicas, ready=0, ready_text=f"0/{spec.trainer.replicas}"
    )
    decision.gang_restart = True


def _where(spec: GRPOJobSpec, status: GRPOJobStatus, v: Verdict) -> str:
    """Which pod, which ranks, which step: what on-call needs before opening any log."""
    per_pod = spec.trainer.processes_per_pod
    index = int(v.pod.rsplit("-", 1)[-1]) if v.pod.rsplit("-", 1)[-1].isdigit() else None
    text = v.describe()
    if index is not None:
        text += f" [ranks {index * per_pod}-{index * per_pod + per_pod - 1}"
        step = status.progress.step if status.progress else None
        text += f", after step {step}]" if step is not None else "]"
    return text


def _progress_phase(
    spec: GRPOJobSpec, old: GRPOJobStatus, status: GRPOJobStatus, obs: Observation, now: datetime
) -> None:
    """Pending → Starting → Running, staying Restarting until the new gang is all ready. Like the
    rollout, the reward model servers (spec.reward.model) need one ready server: rollouts score there."""
    t, r = spec.trainer.replicas, spec.rollout.replicas
    m = spec.reward.model.replicas if spec.reward.model is not None else 0
    trainers_ready = obs.trainer.ready >= t
    rollout_ok = r == 0 or obs.rollout.ready > 0
    reward_ok = m == 0 or obs.reward.ready > 0
    set_condition(status, ConditionType.CREATED, True, Reason.CHILDREN_CREATED, "children applied", now)
    if trainers_ready and rollout_ok and reward_ok:
        status.phase = Phase.RUNNING
        status.message = f"{obs.trainer.ready}/{t} trainer and {obs.rollout.ready}/{r} rollout pods ready"
        if m:
            status.message += f", {obs.reward.ready}/{m} reward model servers ready"
        set_condition(status, ConditionType.RUNNING, True, Reason.ALL_READY, status.message, now)
        restarting = next((c for c in status.conditions if c.type == ConditionType.RESTARTING), None)
        if restarting is not None and restarting.status == "True":
            back = f"trainer gang running again after: {restarting.message}"
            set_condition(status, ConditionType.RESTARTING, False, Reason.ALL_READY, back, now)
        return
    if old.phase == Phase.RESTARTING:
        status.phase = Phase.RESTARTING
        return
    scheduled = obs.trainer.scheduled >= t and obs.rollout.scheduled >= r and obs.reward.scheduled >= m
    status.phase = Phase.STARTING if scheduled else Phase.PENDING
    reason = Reason.PODS_STARTING if scheduled else Reason.PODS_PENDING
    status.message = (
        f"trainer {obs.trainer.ready}/{t} ready ({obs.trainer.scheduled} scheduled), "
        f"rollout {obs.rollout.ready}/{r} ready ({obs.rollout.scheduled} scheduled)"
    )
    if m:
        status.message += f", reward {obs.reward.ready}/{m} ready ({obs.reward.scheduled} scheduled)"
    blocked = obs.trainer.unschedulable or obs.rollout.unschedulable or obs.reward.unschedulable
    if blocked:  # pods pending forever should say why, not stay silent
        status.message += f"; unschedulable {blocked}"
    set_condition(status, ConditionType.RUNNING, False, reason, status.message, now)


def _suspended(old: GRPOJobStatus, status: GRPOJobStatus, now: datetime) -> Decision:
    """Suspended jobs keep no pods; like a Job, the deadline clock restarts on resume."""
    status.phase = Phase.SUSPENDED
    status.start_time = None
    status.message = "job suspended: pods removed, children kept"
    set_condition(status, ConditionType.SUSPENDED, True, Reason.SUSPENDED, status.message, now)
    set_condition(status, ConditionType.RUNNING, False, Reason.SUSPENDED, status.message, now)
    return _with_events(old, Decision(status=status, running=False))


def _queued(old: GRPOJobStatus, status: GRPOJobStatus, now: datetime, queue: Admission) -> Decision:
    """Not admitted by Kueue (yet, or any more): no pods, like a suspended job."""
    status.phase = Phase.SUSPENDED
    status.start_time = None
    status.message = queue.why_waiting()
    reason = Reason.EVICTED if queue.evicted is not None else Reason.AWAITING_ADMISSION
    set_condition(status, ConditionType.SUSPENDED, True, reason, status.message, now)
    set_condition(status, ConditionType.RUNNING, False, reason, status.message, now)
    return _with_events(old, Decision(status=status, running=False))


def _terminal(spec: GRPOJobSpec | None, status: GRPOJobStatus, now: datetime) -> Decision:
    """A finished job only waits for its TTL."""
    decision = Decision(status=status, running=False)
    ttl = spec.run_policy.ttl_seconds_after_finished if spec else None
    done = parse_time(status.completion_time)
    if done is not None and (remaining := seconds_left((now - done).total_seconds(), ttl)) is not None:
        decision.delete_job = remaining <= 0
        decision.requeue_after = remaining if remaining > 0 else None
    return decision


def _with_events(old: GRPOJobStatus, decision: Decision) -> Decision:
    """One Event per phase transition (and per gang restart), reason from the newest condition."""
    new = decision.status
    if new.phase == old.phase and not decision.gang_restart:
        return decision
    changed = [c for c in new.conditions if c not in old.conditions and c.status == "True"]
    reason = changed[-1].reason if changed else str(new.phase)
    kind = "Warning" if reason in WARNING_REASONS else "Normal"
    decision.events.append((kind, reason, f"{old.phase or 'New'} → {new.phase}: {new.message or ''}".strip()))
    return decision
