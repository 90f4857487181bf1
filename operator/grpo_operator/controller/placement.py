"""Choose the availability zone of a trainer gang before its pods exist.

Called by `controller.reconcile` when it renders a new gang attempt. Required one-zone pod
affinity alone lets the first rank pick any zone, even one with too few nodes for the rest
of the gang, which then stays Pending forever; picking the zone up front avoids that.
"""

from grpo_operator.render import names
from grpo_operator.render.pods import ZONE_KEY


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
    """(True, its zone) when the trainer StatefulSet was already rendered for `attempt`.

    A replica that takes over from another (failover, upgrade) keeps that zone: choosing
    again from a fleet that has changed since would rewrite the StatefulSet to a zone its
    running pods are not in (OnDelete keeps them, so the template would lie about the gang).
    """
    template = ((statefulset or {}).get("spec") or {}).get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    if labels.get(names.LABEL_ATTEMPT) != str(attempt):
        return False, None
    return True, ((template.get("spec") or {}).get("nodeSelector") or {}).get(ZONE_KEY)
