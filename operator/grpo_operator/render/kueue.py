"""Kueue's side of a queued GRPOJob: its Workload, and the admitted flavors on its pods.

Pure. Called by the controller for jobs labelled `kueue.x-k8s.io/queue-name`: the operator
plays the part Kueue's job integrations play for built-in kinds. It creates one Workload per
job (a pod set per role, each with the role's real pod template, so Kueue counts GPUs, EFA
devices and huge pages against the ClusterQueue's quota), runs the job only while Kueue
admits that Workload, and puts the node labels and tolerations of the assigned
ResourceFlavors on the pods, as Kueue does for a Job.
"""

import copy
from dataclasses import dataclass, field

from grpo_operator.render import names

API_VERSION = "kueue.x-k8s.io/v1beta2"  # Workloads, ResourceFlavors, WorkloadPriorityClasses
# The pod sets, in order; the reward role's only for a job with spec.reward.model (`counts` has it).
ROLES = (names.ROLE_TRAINER, names.ROLE_ROLLOUT, names.ROLE_REWARD)


@dataclass(frozen=True)
class FlavorPlacement:
    """What the ResourceFlavors assigned to one pod set add to its pods."""

    node_labels: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict, ...] = ()


PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"


@dataclass(frozen=True)
class Priority:
    """The class Kueue orders and preempts workloads by, and its value."""

    group: str  # kueue.x-k8s.io (WorkloadPriorityClass) or scheduling.k8s.io (PriorityClass)
    kind: str
    name: str
    value: int


def queue_name(labels: dict[str, str] | None) -> str | None:
    return (labels or {}).get(names.KUEUE_QUEUE_LABEL) or None


def workload(
    *,
    name: str,
    namespace: str,
    uid: str,
    queue: str,
    templates: dict[str, dict],
    counts: dict[str, int],
    priority: Priority | None = None,
) -> dict:
    """The job's Workload: one pod set per role in `counts` with its count and pod template (what Kueue
    counts against quota and matches flavors with: resources, node selector, tolerations),
    and the priority Kueue orders and preempts by (set by a job integration, as here)."""
    out = {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": names.workload(name),
            "namespace": namespace,
            "labels": names.job_labels(name),
            "ownerReferences": [names.owner_reference(name, uid)],
        },
        "spec": {
            "queueName": queue,
            "podSets": [
                {"name": role, "count": counts[role], "template": copy.deepcopy(templates[role])}
                for role in ROLES
                if role in counts
            ],
        },
    }
    if priority is not None:
        ref = {"group": priority.group, "kind": priority.kind, "name": priority.name}
        out["spec"].update(priorityClassRef=ref, priority=priority.value)
    return out


def pod_set_counts(workload_obj: dict) -> dict[str, int]:
    return {ps["name"]: ps["count"] for ps in workload_obj.get("spec", {}).get("podSets", [])}


def with_flavor(template: dict, placement: FlavorPlacement) -> tuple[dict, list[str]]:
    """The template with the flavor's node labels and tolerations added; conflicts (a label
    the job already selects with another value) keep the job's value and are reported."""
    out = copy.deepcopy(template)
    spec = out["spec"]
    selector = dict(spec.get("nodeSelector") or {})
    conflicts = []
    for key, value in placement.node_labels.items():
        if key in selector and selector[key] != value:
            conflicts.append(f"node label {key}={selector[key]} kept over Kueue flavor's {value}")
            continue
        selector[key] = value
    if selector:
        spec["nodeSelector"] = selector
    tolerations = list(spec.get("tolerations") or [])
    tolerations += [t for t in placement.tolerations if t not in tolerations]
    if tolerations:
        spec["tolerations"] = tolerations
    return out, conflicts


def flavor_placement(flavors: list[dict]) -> FlavorPlacement:
    """Merge the ResourceFlavors assigned to one pod set (usually one) into a placement."""
    labels: dict[str, str] = {}
    tolerations: list[dict] = []
    for flavor in flavors:
        spec = flavor.get("spec") or {}
        labels.update(spec.get("nodeLabels") or {})
        tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
    return FlavorPlacement(labels, tuple(tolerations))
