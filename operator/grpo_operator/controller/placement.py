"""Choose the availability zone of a trainer gang before its pods exist.

Called by `controller.reconcile` when it renders a new gang attempt. Required one-zone pod
affinity alone lets the first rank pick any zone, even one with too few nodes for the rest
of the gang, which then stays Pending forever; picking the zone up front avoids that.
`gang_zone` is the thin I/O shell over the two pure choices below.
"""

from grpo_operator.api.job import GRPOJob
from grpo_operator.controller.kube import Kube
from grpo_operator.instance_types import INSTANCE_TYPE_LABEL
from grpo_operator.render import names
from grpo_operator.render.pods import ZONE_KEY


def gang_zone(kube: Kube, job: GRPOJob, meta: dict, attempt: int) -> str | None:
    """The zone of this attempt's gang: read back from the running gang (a replica that took over
    has no memory of the choice), else chosen from the nodes of its instance type; None when
    the job pins no instance type or names its zone itself."""
    trainer = job.spec.trainer
    if trainer.instance_type is None or ZONE_KEY in trainer.node_selector:
        return None
    sts_name = names.statefulset(meta["name"], names.ROLE_TRAINER)
    known, zone = zone_of_running_gang(
        kube.get("apps/v1", "StatefulSet", meta["namespace"], sts_name), attempt
    )
    if known:
        return zone
    return choose_zone(kube.list_nodes(f"{INSTANCE_TYPE_LABEL}={trainer.instance_type}"), trainer.replicas)


def _usable(node: dict) -> bool:
    conds = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
    return ready and not (node.get("spec") or {}).get("unschedulable", False)


def choose_zone(nodes: list[dict], replicas: int) -> str | None:
    """The zone with the most usable nodes (the caller lists nodes of the gang's instance type).

    A zone that holds the whole gang wins over one that does not; ties go to the name that
    sorts first, so the same fleet always gives the same answer. None when no node has a zone
    (for example Karpenter has not launched any yet): the scheduler then decides.
    """
    counts: dict[str, int] = {}
    for node in nodes:
        zone = (node.get("metadata", {}).get("labels") or {}).get(ZONE_KEY)
        if zone and _usable(node):
            counts[zone] = counts.get(zone, 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda z: (counts[z] < replicas, -counts[z], z))


def zone_of_running_gang(statefulset: dict | None, attempt: int) -> tuple[bool, str | None]:
    """(True, its zone) when the trainer StatefulSet was already rendered to run `attempt`.

    A replica that takes over from another (failover, upgrade) keeps that zone: choosing
    again from a fleet that has changed since would rewrite the StatefulSet to a zone its
    running pods are not in (OnDelete keeps them, so the template would lie about the gang).
    A StatefulSet at zero replicas (queued by Kueue, suspended) was rendered with no zone and
    has no pods: its zone is still to be chosen, or the first rank could pick a zone too
    small for the rest of the gang.
    """
    spec = (statefulset or {}).get("spec") or {}
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    if labels.get(names.LABEL_ATTEMPT) != str(attempt) or not spec.get("replicas"):
        return False, None
    return True, ((template.get("spec") or {}).get("nodeSelector") or {}).get(ZONE_KEY)
