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
