"""A rollout server spanning nodes is counted once, by its leader: status, readiness and scaling count
servers; a failed worker pod still gets its verdict (the operator deletes it, and the LeaderWorkerSet
recreates that group)."""

from grpo_operator.controller import observe
from grpo_operator.lifecycle import VerdictKind
from grpo_operator.render import names

from tests.support.status import pod


def member(group: int, worker: int, **kw) -> dict:
    """A pod of server `group` as the LeaderWorkerSet controller labels it (worker 0: the leader)."""
    p = pod("rollout", group, **kw)
    p["metadata"]["name"] = f"j-rollout-{group}" + (f"-{worker}" if worker else "")
    p["metadata"]["labels"] |= {
        names.LABEL_LWS_GROUP_INDEX: str(group),
        names.LABEL_LWS_WORKER_INDEX: str(worker),
    }
    return p


def test_groups_count_as_servers_and_a_failed_worker_is_still_seen() -> None:
    pods = [member(g, w) for g in range(2) for w in range(4)]  # 2 servers of 4 nodes
    obs = observe.summarize([*pods, pod("trainer", 0)], attempt=0)
    assert (obs.rollout.existing, obs.rollout.scheduled, obs.rollout.ready) == (2, 2, 2)
    pods[5] = member(1, 1, phase="Failed", term=1, ready=False)  # a worker of server 1 exits
    obs = observe.summarize(pods, attempt=0)
    assert obs.failed_rollout_pods == ["j-rollout-1-1"]
    assert [(v.kind, v.pod) for v in obs.verdicts] == [(VerdictKind.FAILED, "j-rollout-1-1")]
    assert obs.rollout.ready == 2  # its leader is ready until the group restarts


def test_an_unschedulable_worker_is_the_reason_its_server_waits() -> None:
    stuck = member(0, 2, node=None, ready=False, phase="Pending")
    stuck["status"]["conditions"].append(
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes: no p5en",
        }
    )
    obs = observe.summarize([member(0, 0), member(0, 1), stuck], attempt=0)
    assert obs.rollout.existing == 1
    assert obs.rollout.unschedulable == "j-rollout-0-2: 0/3 nodes: no p5en"


def test_a_group_pod_whose_affinity_lost_matchlabelkeys_degrades_placement_once_with_a_warning() -> None:
    """Kubernetes before 1.31 drops matchLabelKeys from the pods LWS makes from our template (render.groups)
    without a word; the job says so (PlacementDegraded, one Warning Event) instead of placing silently."""
    from datetime import UTC, datetime

    from grpo_operator.api.status import ConditionType, GRPOJobStatus, Reason
    from grpo_operator.controller import status

    from tests.support.render import job, rendered

    wide = {"dataParallelSize": 16, "expertParallelSize": 16}
    r = rendered(job(rollout={"replicas": 1, "instanceType": "p5en.48xlarge", "nodesPerServer": 2,
                              "tensorParallelSize": 1, "vllm": wide}))  # fmt: skip
    lws = next(c for c in r.children if c["kind"] == "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    kept = member(0, 1)
    kept["metadata"]["labels"][names.LABEL_LWS_GROUP_KEY] = "abc123"
    kept["spec"]["affinity"] = template["spec"]["affinity"]  # as a 1.31+ API server keeps it
    assert (
        not observe.group_affinity_dropped(kept) and not observe.summarize([kept], attempt=0).affinity_dropped
    )
    dropped = member(0, 1)
    dropped["metadata"]["labels"][names.LABEL_LWS_GROUP_KEY] = "abc123"
    terms = template["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    dropped["spec"]["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {k: v for k, v in t.items() if k != "matchLabelKeys"} for t in terms]}}  # fmt: skip
    obs = observe.summarize([dropped], attempt=0)
    assert obs.affinity_dropped == "j-rollout-0-1"
    now = datetime.now(UTC)
    first = status.decide(spec=job().spec, generation=1, old=GRPOJobStatus(), obs=obs, now=now)
    cond = next(c for c in first.status.conditions if c.type == ConditionType.PLACEMENT_DEGRADED)
    assert (cond.status, cond.reason) == ("True", Reason.GROUP_AFFINITY_DROPPED) and "1.31" in cond.message
    warnings = [e for e in first.events if e[1] == Reason.GROUP_AFFINITY_DROPPED]
    assert len(warnings) == 1 and warnings[0][0] == "Warning"
    again = status.decide(spec=job().spec, generation=1, old=first.status, obs=obs, now=now)
    assert not [e for e in again.events if e[1] == Reason.GROUP_AFFINITY_DROPPED]  # said once
