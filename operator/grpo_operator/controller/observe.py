"""What the pods of one GRPOJob say: per-pod verdicts and a per-role summary. Pure.

Called by the pod watch handler (to remember failures the StatefulSet controller may erase
within milliseconds by replacing the pod) and by each reconcile (over a fresh pod list).
"""

from dataclasses import dataclass, field

from grpo_operator.lifecycle import Verdict, VerdictKind
from grpo_operator.render import names


def pod_index(pod: dict) -> int:
    meta = pod.get("metadata", {})
    label = (meta.get("labels") or {}).get(names.LABEL_POD_INDEX)
    if label is not None and label.isdigit():
        return int(label)
    return int(meta.get("name", "-0").rsplit("-", 1)[-1])


def pod_attempt(pod: dict) -> int:
    value = (pod.get("metadata", {}).get("labels") or {}).get(names.LABEL_ATTEMPT, "0")
    return int(value) if value.isdigit() else 0


def _terminated(pod: dict, role: str) -> dict | None:
    """The newest termination record of the role's own container (sidecars do not count)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") != role:
            continue
        for key in ("state", "lastState"):
            term = (cs.get(key) or {}).get("terminated")
            if term:
                return term
    return None


def verdict(
    pod: dict, lost_nodes: frozenset[str] | set[str] = frozenset(), *, gone: bool = False
) -> Verdict | None:
    """The verdict on one pod, or None while it is fine (pending, starting or running). `gone`:
    the watch saw it removed. A pod deleted before it was scheduled is no failure: no rank ran in
    it and its StatefulSet makes it again (seen: a new attempt's Pending pod deleted at once took
    the gang's last restart)."""
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    role = (meta.get("labels") or {}).get(names.LABEL_ROLE, "")
    base = {
        "pod": meta.get("name", "?"),
        "role": role,
        "attempt": pod_attempt(pod),
        "created": meta.get("creationTimestamp", ""),
        "job_uid": (meta.get("labels") or {}).get(names.LABEL_JOB_UID, ""),
    }
    term = _terminated(pod, role)
    phase = status.get("phase")
    if (term is not None and term.get("exitCode") == 0) or phase == "Succeeded":
        if role == names.ROLE_TRAINER and pod_index(pod) == 0:
            return Verdict(VerdictKind.SUCCEEDED, **base, exit_code=0)
    elif term is not None:
        why = f"{term.get('reason') or ''} {term.get('message') or ''}".strip()
        return Verdict(VerdictKind.FAILED, **base, exit_code=term.get("exitCode"), reason=why)
    if phase == "Failed":
        return Verdict(VerdictKind.FAILED, **base, reason=status.get("reason") or status.get("message") or "")
    node = (pod.get("spec") or {}).get("nodeName")
    if (gone or meta.get("deletionTimestamp")) and node:
        return Verdict(VerdictKind.DELETED, **base, reason=status.get("reason") or "")
    if node and node in lost_nodes:
        return Verdict(VerdictKind.NODE_LOST, **base, reason=f"node {node} is gone or NotReady")
    return None


def is_group_worker(pod: dict) -> bool:
    """A worker pod of a rollout server spanning nodes (LeaderWorkerSet worker index above 0): part of
    its server, which its leader stands for in the counts."""
    index = (pod.get("metadata", {}).get("labels") or {}).get(names.LABEL_LWS_WORKER_INDEX, "0")
    return index != "0"


@dataclass
class RoleSummary:
    """Pods of one role in the current attempt; for the rollout, servers (a group counts by its leader,
    which is ready only once its workers' engines joined)."""

    existing: int = 0
    scheduled: int = 0
    ready: int = 0
    unschedulable: str = ""
    """unschedulable: the scheduler's reason for the first pod it cannot place, if any."""


@dataclass
class Observation:
    trainer: RoleSummary = field(default_factory=RoleSummary)
    rollout: RoleSummary = field(default_factory=RoleSummary)
    reward: RoleSummary = field(default_factory=RoleSummary)  # spec.reward.model's servers
    verdicts: list[Verdict] = field(default_factory=list)
    stale_trainer_pods: list[str] = field(default_factory=list)
    failed_rollout_pods: list[str] = field(default_factory=list)
    # Failed reward model server pods: deleted, their StatefulSet makes them again (no gang restart).
    failed_reward_pods: list[str] = field(default_factory=list)
    affinity_dropped: str = ""  # a rollout group pod whose group affinity lost matchLabelKeys


def group_affinity_dropped(pod: dict) -> bool:
    """A pod of a rollout group (it carries LWS's group key) whose required pod affinity terms were
    rendered with matchLabelKeys (render.groups) and came back without it: an API server before
    Kubernetes 1.31 (MatchLabelKeysInPodAffinity, beta and on by default from 1.31) drops the field
    without a word, and the term then matches every rollout pod of the job instead of its group's."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if names.LABEL_LWS_GROUP_KEY not in labels:
        return False
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("podAffinity") or {}
    terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or []
    return any(t.get("labelSelector") and not t.get("matchLabelKeys") for t in terms)


def _is_ready(pod: dict) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _unschedulable(pod: dict) -> str:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
            return f"{pod['metadata']['name']}: {c.get('message', 'unschedulable')}"
    return ""


def summarize(
    pods: list[dict], *, attempt: int, lost_nodes: frozenset[str] | set[str] = frozenset()
) -> Observation:
    """Count the current attempt's pods and collect verdicts; older trainer pods are stale."""
    obs = Observation()
    for pod in pods:
        meta = pod.get("metadata", {})
        role = (meta.get("labels") or {}).get(names.LABEL_ROLE)
        if role == names.ROLE_TRAINER and pod_attempt(pod) != attempt:
            if not meta.get("deletionTimestamp"):
                obs.stale_trainer_pods.append(meta["name"])
            continue
        summaries = {names.ROLE_TRAINER: obs.trainer, names.ROLE_REWARD: obs.reward}
        summary = summaries.get(role, obs.rollout)
        v = verdict(pod, lost_nodes)
        if v is not None:
            obs.verdicts.append(v)
            failed = v.kind == VerdictKind.FAILED and not meta.get("deletionTimestamp")
            if role == names.ROLE_ROLLOUT and failed:
                obs.failed_rollout_pods.append(meta["name"])
            elif role == names.ROLE_REWARD and failed:
                obs.failed_reward_pods.append(meta["name"])
        if meta.get("deletionTimestamp"):
            continue
        if role == names.ROLE_ROLLOUT and not obs.affinity_dropped and group_affinity_dropped(pod):
            obs.affinity_dropped = meta.get("name", "?")
        if role == names.ROLE_ROLLOUT and is_group_worker(pod):
            summary.unschedulable = summary.unschedulable or _unschedulable(pod)
            continue
        summary.existing += 1
        summary.scheduled += bool((pod.get("spec") or {}).get("nodeName"))
        summary.unschedulable = summary.unschedulable or _unschedulable(pod)
        summary.ready += _is_ready(pod) and (v is None or v.kind == VerdictKind.SUCCEEDED)
    return obs
