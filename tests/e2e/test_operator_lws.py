"""E2E: rollout servers that span nodes (spec.rollout.nodesPerServer > 1), as the operator runs them
with the real LeaderWorkerSet controller (sigs.k8s.io/lws, hack/lws.sh) on kwok p5en nodes.

A job with 2-node servers comes up as LWS groups (leader pods named as one-node servers are, one
worker each, every pod on a node of its own); a worker whose container restarted (what a kubelet
reports after a crash) restarts its own group only, not the trainer gang and not the other
server; `kubectl scale` changes the number of groups; deleting the job removes everything. Without
the LWS API the job says so (APINotServed) and renders nothing of it, then recovers once LWS is
installed. That the trainer sends a lost server's prompts to the others is the generator's own
behaviour, tested with real servers in tests/integration/test_rollout_client.py: kwok runs no
container.
"""

import datetime
import subprocess
from pathlib import Path

from grpo_operator.api.job import GROUP, PLURAL, VERSION
from grpo_operator.render import names
from kubernetes import client

from tests.support import operator_e2e as e2e
from tests.support.operator_e2e import manifest

crd, operator, cluster = e2e.crd, e2e.operator, e2e.cluster  # the fixtures, by name
LWS_SH = Path(__file__).resolve().parents[2] / "hack" / "lws.sh"
LWS_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
WIDE = {
    "replicas": 2,
    "instanceType": "p5en.48xlarge",
    "nodesPerServer": 2,
    "tensorParallelSize": 1,
    "vllm": {"dataParallelSize": 16, "expertParallelSize": 16},
}


def lws(cluster, name: str) -> dict | None:
    try:
        return cluster.custom.get_namespaced_custom_object(
            LWS_GROUP, LWS_VERSION, cluster.ns, LWS_PLURAL, f"{name}-rollout"
        )
    except Exception:
        return None


def groups_ready(cluster, name: str, servers: int) -> dict[str, object] | None:
    """The rollout pods once `servers` groups of 2 are Ready, by name; None before."""
    pods = cluster.ready(name, "rollout", 2 * servers)
    return {p.metadata.name: p for p in pods} or None


def test_servers_spanning_two_nodes_are_groups_that_restart_alone_scale_and_go(
    lws_controller, operator, cluster, kubectl, wait_for
):
    cluster.create(manifest("wide", rollout=WIDE))
    cluster.wait_phase("wide", "Running", timeout=120)
    pods = wait_for(lambda: groups_ready(cluster, "wide", 2), what="2 groups of 2 ready", timeout=120)
    assert sorted(pods) == ["wide-rollout-0", "wide-rollout-0-1", "wide-rollout-1", "wide-rollout-1-1"]
    nodes = [p.spec.node_name for p in pods.values()]
    assert len(set(nodes)) == 4 and all(n.startswith("p5en-") for n in nodes), nodes  # a node each
    leader, worker = pods["wide-rollout-1"], pods["wide-rollout-1-1"]
    assert leader.spec.containers[0].command[-1] == "serve"
    assert worker.spec.containers[0].command[-1] == "headless"
    worker_env = {e.name: e.value for e in worker.spec.containers[0].env}
    assert worker_env["LWS_LEADER_ADDRESS"] == f"wide-rollout-1.wide-rollout.{cluster.ns}"
    assert worker_env["LWS_WORKER_INDEX"] == "1"
    assert worker.metadata.labels[names.LABEL_JOB_UID] == cluster.job("wide")["metadata"]["uid"]
    wait_for(lambda: cluster.status("wide").get("rollout", {}).get("readyText") == "2/2", what="2/2 servers")
    assert cluster.status("wide")["rolloutAll2allBackend"] == "deepep_v2"
    owner = lws(cluster, "wide")["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("GRPOJob", "wide")
    service = cluster.core.read_namespaced_service("wide-rollout", cluster.ns)  # ours, not LWS's
    assert service.metadata.owner_references[0].kind == "GRPOJob"
    assert (
        service.spec.publish_not_ready_addresses
        and service.spec.selector[names.LABEL_LWS_WORKER_INDEX] == "0"
    )

    # A worker's container crashed and was restarted: its group restarts, nothing else does.
    trainers, before = cluster.uids("wide", "trainer"), cluster.uids("wide", "rollout")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ended = {"exitCode": 1, "reason": "Error", "startedAt": now, "finishedAt": now}
    body = {
        "status": {
            "containerStatuses": [{"name": "rollout", "restartCount": 1, "lastState": {"terminated": ended}}]
        }
    }
    cluster.core.patch_namespaced_pod_status(
        "wide-rollout-1-1", cluster.ns, body, _content_type="application/strategic-merge-patch+json"
    )

    def group_1_new() -> bool:
        now_uids = cluster.uids("wide", "rollout")
        fresh = all(now_uids.get(p) not in (None, before[p]) for p in ("wide-rollout-1", "wide-rollout-1-1"))
        return fresh and groups_ready(cluster, "wide", 2) is not None

    wait_for(group_1_new, what="group 1 recreated and ready", timeout=120)
    after = cluster.uids("wide", "rollout")
    assert {p: after[p] for p in ("wide-rollout-0", "wide-rollout-0-1")} == {
        p: before[p] for p in ("wide-rollout-0", "wide-rollout-0-1")
    }
    assert cluster.uids("wide", "trainer") == trainers
    assert cluster.status("wide").get("restarts", 0) == 0

    # kubectl scale counts servers: a third group of two pods.
    kubectl("scale", "-n", cluster.ns, f"{PLURAL}.{GROUP}/wide", "--replicas=3")
    pods = wait_for(lambda: groups_ready(cluster, "wide", 3), what="3 groups of 2 ready", timeout=120)
    assert {"wide-rollout-2", "wide-rollout-2-1"} <= set(pods)
    assert lws(cluster, "wide")["spec"]["replicas"] == 3
    scale = cluster.custom.get_namespaced_custom_object_scale(GROUP, VERSION, cluster.ns, PLURAL, "wide")
    assert scale["status"]["replicas"] == 3  # servers, for an HPA or KEDA, selecting one pod each
    assert (
        scale["status"]["selector"]
        == f"grpo.dev/job=wide,grpo.dev/role=rollout,{names.LABEL_LWS_WORKER_INDEX}=0"
    )
    wait_for(lambda: cluster.status("wide").get("rollout", {}).get("readyText") == "3/3", what="3/3 servers")
    policies = (
        client.NetworkingV1Api(cluster.core.api_client).list_namespaced_network_policy(cluster.ns).items
    )
    assert {f"wide-rollout-group-{g}" for g in range(3)} <= {p.metadata.name for p in policies}
    contract = cluster.core.read_namespaced_config_map("wide-contract", cluster.ns).data["job.json"]
    assert f"wide-rollout-2.wide-rollout.{cluster.ns}.svc" in contract

    # Deleting the job removes the LWS and every pod of every group.
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "wide")
    wait_for(lambda: lws(cluster, "wide") is None, what="the LWS gone", timeout=90)
    wait_for(lambda: not cluster.core.list_namespaced_pod(cluster.ns).items, what="no pods", timeout=90)


def test_without_the_lws_api_the_job_says_so_and_recovers_once_it_is_installed(
    lws_controller, operator, cluster, wait_for
):
    """The LWS CRD removed (hack/lws.sh uninstall-crd) and put back (up): meanwhile the job renders
    nothing of itself and its ReconcileError condition names the field and what to install."""
    subprocess.run(["bash", str(LWS_SH), "uninstall-crd"], check=True, capture_output=True, timeout=300)
    try:
        cluster.create(manifest("nolws", rollout=WIDE | {"replicas": 1}))
        condition = wait_for(
            lambda: cluster.has_condition("nolws", "ReconcileError"), what="ReconcileError", timeout=60
        )
        assert condition["status"] == "True" and condition["reason"] == "APINotServed", condition
        assert "rollout.nodesPerServer" in condition["message"] and "LeaderWorkerSet" in condition["message"]
        assert not cluster.pods("nolws", "trainer")  # nothing of the job was applied: no half gang
    finally:
        subprocess.run(["bash", str(LWS_SH), "up"], check=True, capture_output=True, timeout=300)
    wait_for(lambda: groups_ready(cluster, "nolws", 1), what="the group, once LWS is installed", timeout=420)
    wait_for(
        lambda: (c := cluster.has_condition("nolws", "ReconcileError")) is None or c["status"] == "False",
        what="the condition cleared",
        timeout=60,
    )
