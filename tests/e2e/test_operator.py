"""E2E: `grpo-operator operator` as a real process against the local control plane (kwok EKS nodes).

Covers the operator issue's "must be true" list: children and EFA placement, phases,
gang restart and backoff, rollout-only replacement, suspend/resume, deletion, restart
safety, bad objects, live rollout scaling, success, and a steady state that writes nothing.
"""

import contextlib
import datetime
import json
import signal
import time
import urllib.request

import pytest
from grpo_operator.api.job import GROUP, PLURAL, VERSION
from grpo_operator.api.report import AttemptStart, ep_progress
from kubernetes import client

from tests.support import operator_e2e as e2e
from tests.support.kueue_status import KUEUE, condition
from tests.support.operator_e2e import Operator, manifest

crd, operator, cluster, kueue_operator = e2e.crd, e2e.operator, e2e.cluster, e2e.kueue_operator  # by name
ZONE_KEY = "topology.kubernetes.io/zone"


def test_p5_job_gets_children_efa_pods_and_runs(operator, cluster, kubectl, wait_for):
    cluster.create(
        manifest("moe", rollout={"replicas": 2, "instanceType": "p5en.48xlarge", "tensorParallelSize": 8})
    )
    wait_for(lambda: len(cluster.children()) == 13, what="13 children", timeout=60)
    uid = cluster.job("moe")["metadata"]["uid"]
    assert cluster.children() == sorted(
        [
            "configmap/moe-contract",
            "networkpolicy.networking.k8s.io/moe-rollout",
            "networkpolicy.networking.k8s.io/moe-trainer",
            "poddisruptionbudget.policy/moe-trainer",
            "role.rbac.authorization.k8s.io/moe-trainer",
            "rolebinding.rbac.authorization.k8s.io/moe-trainer",
            f"secret/moe-token-{uid[:8]}",
            "service/moe-rollout",
            "service/moe-trainer",
            "serviceaccount/moe-rollout",
            "serviceaccount/moe-trainer",
            "statefulset.apps/moe-rollout",
            "statefulset.apps/moe-trainer",
        ]
    )
    seen = set()

    def running():
        seen.add(cluster.status("moe").get("phase"))
        return cluster.status("moe").get("phase") == "Running"

    wait_for(running, what="moe Running", timeout=90, interval=0.2)
    assert seen - {None} <= {"Pending", "Starting", "Running"}
    trainers = cluster.ready("moe", "trainer", 2)
    assert trainers
    nodes = {n.metadata.name: n for n in cluster.core.list_node().items}
    for p in trainers:
        c = p.spec.containers[0]
        assert (
            c.resources.limits["nvidia.com/gpu"] == "8"
            and c.resources.limits["vpc.amazonaws.com/efa"] == "32"
        )
        env = {e.name: e.value for e in c.env}
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        labels = nodes[p.spec.node_name].metadata.labels
        assert labels["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        assert labels["topology.kubernetes.io/zone"] == "us-west-2a"
    for p in cluster.ready("moe", "rollout", 2):
        assert nodes[p.spec.node_name].metadata.labels["node.kubernetes.io/instance-type"] == "p5en.48xlarge"
    st = cluster.status("moe")
    assert st["trainer"]["readyText"] == "2/2" and st["rollout"]["ready"] == 2
    assert st["observedGeneration"] == cluster.job("moe")["metadata"]["generation"]
    table = kubectl("get", "grpo", "-n", cluster.ns).stdout
    assert "moe" in table and "Running" in table
    events = kubectl("get", "events", "-n", cluster.ns, "--field-selector", "involvedObject.name=moe").stdout
    assert "AllReplicasReady" in events
    contract = json.loads(
        cluster.core.read_namespaced_config_map("moe-contract", cluster.ns).data["job.json"]
    )
    assert contract["trainer"]["masterAddr"] == f"moe-trainer-0.moe-trainer.{cluster.ns}.svc"
    # steady state: passes keep running (resync 2 s) but nothing is written
    before = operator.writes()
    time.sleep(8)
    assert operator.writes() == before
    code, text = operator.get("/metrics")
    assert (
        code == 200
        and "grpo_operator_reconciles_total" in text
        and 'grpo_operator_jobs{phase="Running"} 1.0' in text
    )
    assert operator.get("/healthz")[0] == 200


def test_trainer_failure_restarts_the_gang_then_backoff_fails(operator, cluster, fail_pod, wait_for):
    cluster.create(manifest("gang", runPolicy={"backoffLimit": 1}))
    cluster.wait_phase("gang", "Running")
    trainers, rollouts = cluster.uids("gang", "trainer"), cluster.uids("gang", "rollout")
    fail_pod(cluster.ns, "gang-trainer-1", exit_code=1)
    wait_for(lambda: cluster.status("gang").get("restarts") == 1, what="restarts == 1")
    wait_for(
        lambda: (
            (u := cluster.uids("gang", "trainer"))
            and len(u) == 2
            and not set(u.values()) & set(trainers.values())
        ),
        what="both trainer pods replaced",
        timeout=120,  # a loaded machine slows the StatefulSet controller's create-after-delete backoff
    )
    assert cluster.uids("gang", "rollout") == rollouts
    st = cluster.wait_phase("gang", "Running")
    assert st["restarts"] == 1
    assert "gang-trainer-1 failed with exit code 1" in cluster.condition("gang", "Restarting")["message"]
    fail_pod(cluster.ns, "gang-trainer-0", exit_code=1)
    cluster.wait_phase("gang", "Failed")
    failed = cluster.condition("gang", "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "backoffLimit=1" in failed["message"]
    wait_for(
        lambda: not cluster.pods("gang", "trainer") and not cluster.pods("gang", "rollout"),
        what="pods stopped",
    )


def test_rollout_failure_replaces_only_that_pod(operator, cluster, fail_pod, wait_for):
    cluster.create(manifest("ro"))
    cluster.wait_phase("ro", "Running")
    trainers, rollouts = cluster.uids("ro", "trainer"), cluster.uids("ro", "rollout")
    fail_pod(cluster.ns, "ro-rollout-0", exit_code=1)
    wait_for(
        lambda: cluster.uids("ro", "rollout").get("ro-rollout-0") not in (None, rollouts["ro-rollout-0"]),
        what="rollout-0 replaced",
    )
    assert cluster.uids("ro", "rollout")["ro-rollout-1"] == rollouts["ro-rollout-1"]
    assert cluster.uids("ro", "trainer") == trainers
    assert cluster.status("ro").get("restarts", 0) == 0


def test_permanent_exit_code_fails_at_once(operator, cluster, fail_pod):
    cluster.create(manifest("perm"))
    cluster.wait_phase("perm", "Running")
    fail_pod(cluster.ns, "perm-trainer-1", exit_code=3)
    cluster.wait_phase("perm", "Failed")
    assert cluster.condition("perm", "Failed")["reason"] == "PermanentError"
    assert cluster.status("perm").get("restarts", 0) == 0


def test_suspend_removes_pods_and_resume_restores_them(operator, cluster, wait_for):
    cluster.create(manifest("sus"))
    cluster.wait_phase("sus", "Running")
    children = cluster.children()
    cluster.patch("sus", {"runPolicy": {"suspend": True}})
    cluster.wait_phase("sus", "Suspended")
    wait_for(
        lambda: not cluster.pods("sus", "trainer") and not cluster.pods("sus", "rollout"), what="no pods"
    )
    assert cluster.children() == children
    assert cluster.condition("sus", "Suspended")["status"] == "True"
    cluster.patch("sus", {"runPolicy": {"suspend": False}})
    cluster.wait_phase("sus", "Running")
    assert len(cluster.ready("sus", "trainer", 2)) == 2
    assert cluster.condition("sus", "Suspended")["reason"] == "JobResumed"


def test_rollout_autoscaling_follows_the_trainers_wait_and_never_writes_spec(operator, cluster, wait_for):
    scaling = {"targetWaitFraction": 0.1, "scaleUpCooldownSeconds": 0, "scaleDownCooldownSeconds": 5}
    rollout = {"replicas": 1, "minReplicas": 1, "maxReplicas": 3, "engine": "torch", "autoscaling": scaling}
    cluster.create(manifest("elastic", rollout=rollout))
    cluster.wait_phase("elastic", "Running")
    applied = cluster.job("elastic")["spec"]

    def report(wait: float) -> None:  # what trainer rank 0 patches after a step
        stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        progress = {"step": 3, "rolloutWaitFraction": wait, "updatedAt": stamp}
        cluster.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, cluster.ns, PLURAL, "elastic", {"status": {"progress": progress}}
        )

    def servers() -> int:
        return cluster.apps.read_namespaced_stateful_set("elastic-rollout", cluster.ns).spec.replicas

    report(0.5)  # waits 5x the target: up, at most doubling per move, to maxReplicas
    wait_for(lambda: servers() == 3, what="rollout scaled up to maxReplicas", timeout=60)

    def status_says(replicas: int) -> dict | None:
        """The status once it says `replicas`: a pass scales the StatefulSet, then writes status."""
        status = cluster.status("elastic")
        return status if status["rollout"]["replicas"] == replicas else None

    status = wait_for(lambda: status_says(3), what="status.rollout.replicas 3", timeout=30)
    assert status["rolloutScaling"]["reason"] == "TrainerWaiting"
    assert status["rollout"]["selector"] == "grpo.dev/job=elastic,grpo.dev/role=rollout"
    assert len(cluster.ready("elastic", "rollout", 3) or cluster.pods("elastic", "rollout")) == 3
    report(0.0)  # idle rollouts: one server fewer per cooldown, down to minReplicas
    wait_for(lambda: servers() == 1, what="rollout scaled down to minReplicas", timeout=60)
    status = wait_for(lambda: status_says(1), what="status.rollout.replicas 1", timeout=30)
    assert status["rolloutScaling"]["reason"] == "RolloutsIdle"

    def moves() -> list[str]:
        events = cluster.core.list_namespaced_event(cluster.ns, field_selector="involvedObject.name=elastic")
        return [e.reason for e in events.items if e.reason in {"TrainerWaiting", "RolloutsIdle"}]

    # a move's Event is posted after the pass that scaled: the last one may trail the replica count
    wait_for(lambda: len(moves()) >= 4, what="four scaling Events", timeout=30)
    assert moves().count("TrainerWaiting") == 2 and moves().count("RolloutsIdle") == 2, moves()
    final = cluster.job("elastic")
    assert final["spec"] == applied and final["metadata"]["generation"] == 1  # spec never written
    scale = cluster.custom.get_namespaced_custom_object_scale(GROUP, VERSION, cluster.ns, PLURAL, "elastic")
    assert scale["status"]["selector"] == "grpo.dev/job=elastic,grpo.dev/role=rollout"


def test_the_auto_choice_and_a_wrong_learning_signal_are_announced_once(operator, cluster, wait_for):
    cluster.create(manifest("auto"))
    cluster.wait_phase("auto", "Running")
    candidates = {
        "nccl": "1.250 ms",
        "deepep_v1": "skipped: rank 0: the EP group spans 2 nodes",
        "deepep_v2": "failed: rank 3: RuntimeError: NCCL GIN is unavailable",
    }

    def report(progress: dict) -> None:
        cluster.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, cluster.ns, PLURAL, "auto", {"status": {"progress": progress}}
        )

    def announced(reason: str) -> list:
        events = cluster.core.list_namespaced_event(cluster.ns, field_selector="involvedObject.name=auto")
        return [e for e in events.items if e.reason == reason]

    # what rank 0 writes once `auto` has chosen, before its first step (which can take minutes)
    start = AttemptStart(ep_backend="nccl", ep_candidates=candidates, time=time.time())
    report(start.to_progress_patch())
    wait_for(lambda: announced("EPBackendChosen"), what="an EPBackendChosen Event", timeout=30)
    assert not cluster.status("auto")["progress"].get("step")  # no step reported yet
    for step in (1, 2):  # rank 0 repeats the choice in every step's report: announced once
        stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        wrong = {"rewardTimeouts": 3 * step, "episodesCutFraction": 0.75}  # issue 46: said once each
        report({"step": step, "updatedAt": stamp} | wrong | ep_progress("nccl", candidates))
        time.sleep(5)  # two resync passes (--resync-seconds 2) see each report
    (chosen,) = announced("EPBackendChosen")
    assert chosen.type == "Normal" and "nccl" in chosen.message and "1.250 ms" in chosen.message
    assert "spans 2 nodes" in chosen.message and (chosen.count or 1) == 1
    (failed,) = announced("EPBackendFailed")
    assert failed.type == "Warning" and "deepep_v2" in failed.message
    assert "GIN is unavailable" in failed.message
    assert (failed.count or 1) == 1
    assert operator.metric("grpo_operator_ep_backend_failures_total") == 1
    assert operator.metric("grpo_operator_ep_backend_refused_total") == 1
    (timeouts,) = announced("RewardTimeouts")
    assert timeouts.type == "Warning" and "spec.reward.timeoutSeconds" in timeouts.message
    (cut,) = announced("EpisodesCutByBudget")
    assert cut.type == "Warning" and "75% of a step's episodes" in cut.message
    assert "spec.algorithm.maxNewTokens=" in cut.message and (cut.count or 1) == 1
    assert operator.metric("grpo_operator_signal_warnings_total") == 2


def test_live_rollout_replicas_and_success(operator, cluster, fail_pod, wait_for):
    cluster.create(manifest("live"))
    cluster.wait_phase("live", "Running")
    cluster.patch("live", {"rollout": {"replicas": 3}})
    wait_for(lambda: cluster.ready("live", "rollout", 3), what="3 rollout pods")
    contract = json.loads(
        cluster.core.read_namespaced_config_map("live-contract", cluster.ns).data["job.json"]
    )
    assert len(contract["rollout"]["endpoints"]) == 3
    wait_for(lambda: cluster.status("live").get("rollout", {}).get("readyText") == "3/3", what="status 3/3")
    fail_pod(cluster.ns, "live-trainer-0", exit_code=0, reason="Completed")
    cluster.wait_phase("live", "Succeeded")
    assert cluster.condition("live", "Succeeded")["reason"] == "TrainingCompleted"
    wait_for(
        lambda: not cluster.pods("live", "rollout") and not cluster.pods("live", "trainer"),
        what="pods stopped",
    )


def test_deleting_the_job_removes_every_child(operator, cluster, wait_for):
    cluster.create(manifest("gone"))
    cluster.wait_phase("gone", "Running")
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "gone")
    wait_for(lambda: not cluster.children(), what="no children", timeout=90)
    wait_for(lambda: not cluster.core.list_namespaced_pod(cluster.ns).items, what="no pods", timeout=90)


def test_operator_killed_mid_reconcile_creates_no_duplicates(operator, cluster, wait_for):
    cluster.create(manifest("crash"))
    wait_for(lambda: cluster.children(), what="first child", timeout=60, interval=0.05)
    operator.kill(signal.SIGKILL)
    operator.start()
    cluster.wait_phase("crash", "Running")
    time.sleep(3)
    assert len(cluster.children()) == 13
    assert len(cluster.pods("crash", "trainer")) == 2 and len(cluster.pods("crash", "rollout")) == 2
    assert cluster.status("crash").get("restarts", 0) == 0
    secrets = [
        s
        for s in cluster.core.list_namespaced_secret(cluster.ns).items
        if s.metadata.name.startswith("crash")
    ]
    assert len(secrets) == 1


def test_new_leader_keeps_the_running_gang_in_its_zone(operator, cluster, wait_for):
    """The gang's zone is chosen once per attempt. A replica that takes over (failover, upgrade)
    must read it back from the running gang, not choose again from a fleet that has changed
    since: that would rewrite the StatefulSet to a zone its running pods are not in."""
    cluster.create(manifest("stay"))
    cluster.wait_phase("stay", "Running")
    sts = cluster.apps.read_namespaced_stateful_set("stay-trainer", cluster.ns)
    zone = sts.spec.template.spec.node_selector[ZONE_KEY]
    pods = cluster.uids("stay", "trainer")
    operator.kill(signal.SIGKILL)
    sel = f"node.kubernetes.io/instance-type=p5.48xlarge,{ZONE_KEY}={zone}"
    nodes = [n.metadata.name for n in cluster.core.list_node(label_selector=sel).items]
    try:  # the gang's zone now has no schedulable node: a fresh choice would move it
        for n in nodes:
            cluster.core.patch_node(n, {"spec": {"unschedulable": True}})
        operator.start()
        wait_for(lambda: operator.get("/healthz")[0] == 200, what="healthz", ignore=(urllib.error.URLError,))
        time.sleep(6)  # three resync passes
        sts = cluster.apps.read_namespaced_stateful_set("stay-trainer", cluster.ns)
        assert sts.spec.template.spec.node_selector[ZONE_KEY] == zone
        assert cluster.uids("stay", "trainer") == pods
        assert cluster.status("stay").get("restarts", 0) == 0
    finally:
        for n in nodes:
            cluster.core.patch_node(n, {"spec": {"unschedulable": False}})


def test_sigterm_stops_the_operator_at_once(operator, wait_for):
    """A rolling update or drain SIGTERMs the pod; kopf waits 5 s for stray tasks before it
    exits, so a heartbeat left running would hold every operator restart that long."""
    wait_for(lambda: operator.get("/healthz")[0] == 200, what="healthz", ignore=(urllib.error.URLError,))
    # /healthz answers from process start; kopf's own SIGTERM handling exists once its startup ran
    wait_for(lambda: "Activity 'heartbeat' succeeded." in operator.log.read_text(), what="kopf started")
    operator.proc.send_signal(signal.SIGTERM)
    assert operator.proc.wait(timeout=30) == 0
    # The cleanup handler cancelled the heartbeat: kopf had no stray task to wait 5 s for.
    assert "Activity 'stop_heartbeat' succeeded." in operator.log.read_text()


def test_bad_object_fails_clearly_and_operator_keeps_running(operator, cluster):
    cluster.create(manifest("bad", trainer={"replicas": 1, "instanceType": "p9.bogus"}))
    cluster.wait_phase("bad", "Failed")
    failed = cluster.condition("bad", "Failed")
    assert failed["reason"] == "InvalidSpec" and "unknown instance type 'p9.bogus'" in failed["message"]
    assert operator.proc.poll() is None
    cluster.create(manifest("good"))
    cluster.wait_phase("good", "Running")
    assert cluster.children() and "statefulset.apps/bad-trainer" not in cluster.children()
    # a live edit that no longer renders is refused: the job runs on, its pods and children untouched
    trainers = cluster.uids("good", "trainer")
    cluster.patch("good", {"rollout": {"instanceType": "p9.bogus"}})
    rejected = cluster.wait_for(lambda: cluster.has_condition("good", "UpdateRejected"), what="refused")
    assert rejected["status"] == "True"
    assert "rollout.instanceType: unknown instance type" in rejected["message"]
    assert cluster.status("good")["phase"] == "Running" and cluster.uids("good", "trainer") == trainers
    sts = cluster.apps.read_namespaced_stateful_set("good-rollout", cluster.ns)
    assert sts.spec.replicas == 2 and "p9.bogus" not in json.dumps(sts.to_dict(), default=str)
    events = cluster.core.list_namespaced_event(cluster.ns, field_selector="involvedObject.name=good").items
    assert any(e.reason == "InvalidSpec" and "not applied" in e.message for e in events)
    cluster.patch("good", {"rollout": {"instanceType": None}})  # fixed: the condition clears
    cluster.wait_for(
        lambda: cluster.condition("good", "UpdateRejected")["status"] == "False", what="accepted"
    )


def test_poison_specs_get_a_status_back_off_and_never_block_a_healthy_job(operator, cluster, wait_for):
    # well-typed, so admitted; but the mount names no volume: the API server refuses the StatefulSet
    mount = {
        "spec": {"containers": [{"name": "trainer", "volumeMounts": [{"name": "nope", "mountPath": "/x"}]}]}
    }
    cluster.create(manifest("poison", trainer={"replicas": 1, "template": mount}))
    failed = wait_for(lambda: cluster.has_condition("poison", "ReconcileError"), what="a status", timeout=60)
    assert failed["status"] == "True" and "answered 422" in failed["message"] and "nope" in failed["message"]
    events = cluster.core.list_namespaced_event(cluster.ns, field_selector="involvedObject.name=poison").items
    assert [e.reason for e in events if e.type == "Warning"].count("ReconcileFailed") == 1
    errors = operator.metric("grpo_operator_reconcile_errors_total")
    cluster.create(manifest("healthy"))
    cluster.wait_phase("healthy", "Running")
    time.sleep(12)  # resync is 2 s: without backoff (5, 10, 20 s) this would be 6 more failed passes
    assert operator.metric("grpo_operator_reconcile_errors_total") - errors <= 3
    assert operator.get("/healthz")[0] == 200


def test_deleting_a_job_does_not_wait_for_the_operator(operator, cluster, wait_for):
    cluster.create(manifest("orphan"))
    cluster.wait_phase("orphan", "Running")
    assert not cluster.job("orphan")["metadata"].get("finalizers")
    operator.kill()  # scaled to zero, or crashed
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "orphan")
    wait_for(lambda: cluster.gone("orphan"), what="job deleted without an operator", timeout=30)
    wait_for(lambda: not cluster.children(), what="children garbage-collected", timeout=90)


def test_a_job_that_bypassed_admission_is_failed_and_never_rendered(operator, cluster):
    privileged = manifest("sneaky", network={"privileged": True})  # no approval annotation
    cluster.create(privileged)  # this namespace has no admission policy bound: only the operator guards
    cluster.wait_phase("sneaky", "Failed")
    failed = cluster.condition("sneaky", "Failed")
    assert failed["reason"] == "EscalationNotApproved" and "spec.network.privileged" in failed["message"]
    assert not [c for c in cluster.children() if "sneaky" in c]


def test_one_leader_among_replicas(crd, kubeconfig, kubectl, namespace, cluster, tmp_path):
    """Two replicas with peering: only the higher priority one writes; when it stops, the other takes over."""
    low = Operator(
        kubeconfig, namespace, tmp_path / "low.log", "--peering", "grpo", "--priority", "10"
    ).start()
    high = Operator(
        kubeconfig, namespace, tmp_path / "high.log", "--peering", "grpo", "--priority", "20"
    ).start()
    try:
        cluster.wait_for(
            lambda: high.get("/healthz")[0] == 200 and low.get("/healthz")[0] == 200,
            what="both up",
            ignore=(OSError,),
        )
        time.sleep(3)  # let the peers see each other before there is work
        cluster.create(manifest("lead"))
        cluster.wait_phase("lead", "Running")
        assert high.writes() > 0 and low.writes() == 0
        high.kill(signal.SIGTERM)  # a clean exit removes its peering record
        cluster.patch("lead", {"runPolicy": {"suspend": True}})
        cluster.wait_phase("lead", "Suspended", timeout=120)
        assert low.writes() > 0
        assert len(cluster.children()) == 13
        kubectl("delete", "grpojobs", "--all", "-n", namespace, "--timeout=60s")
    finally:
        high.kill(signal.SIGTERM)
        low.kill(signal.SIGTERM)
        print(low.log.read_text()[-4000:], high.log.read_text()[-4000:])


def fake_p5_node(name: str, zone: str) -> dict:
    """A kwok node shaped like hack/fleet.sh's p5.48xlarge, in a zone of the test's own."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "node.kubernetes.io/instance-type": "p5.48xlarge",
                "topology.kubernetes.io/zone": zone,
            },
        },
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]},
        "status": {
            "allocatable": {
                "cpu": "191450m",
                "memory": "1990Gi",
                "pods": "110",
                "hugepages-2Mi": "10Gi",
                "nvidia.com/gpu": "8",
                "vpc.amazonaws.com/efa": "32",
            },
            "capacity": {
                "cpu": "192",
                "memory": "2048Gi",
                "pods": "110",
                "hugepages-2Mi": "10Gi",
                "nvidia.com/gpu": "8",
                "vpc.amazonaws.com/efa": "32",
            },
        },
    }


def test_node_loss_restarts_the_gang(operator, cluster, wait_for):
    suffix = cluster.ns[-6:]
    zone = f"us-test-{suffix}"
    nodes = [f"lost-{suffix}-{i}" for i in range(3)]
    sentinel = f"never-ready-{suffix}"
    try:
        for n in nodes:
            cluster.core.create_node(fake_p5_node(n, zone))
        trainer = {
            "replicas": 2,
            "instanceType": "p5.48xlarge",
            "nodeSelector": {"topology.kubernetes.io/zone": zone},
        }
        cluster.create(manifest("node", trainer=trainer))
        cluster.wait_phase("node", "Running")
        victim = next(
            p.spec.node_name for p in cluster.pods("node", "trainer") if p.metadata.name == "node-trainer-1"
        )
        # The operator's node watch must be live before the deletion below, or a freshly started
        # operator on a loaded machine misses it. A sentinel node created and deleted: a DELETED
        # event keeps it in the lost-node count for good (kwok manages every node, so a "never
        # Ready" node turned Ready within the poll interval and the count fell back to 0).
        tries = iter(range(1000))

        def watch_live() -> bool:
            name = f"{sentinel}-{next(tries)}"
            cluster.core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
            cluster.core.delete_node(name)
            time.sleep(1)
            return operator.metric("grpo_operator_lost_nodes") >= 1

        wait_for(watch_live, what="node watch live", timeout=90)
        cluster.core.delete_node(victim)
        wait_for(lambda: cluster.status("node").get("restarts") == 1, what="restarts == 1")
        assert victim in cluster.condition("node", "Restarting")["message"]

        def node_lost_event() -> bool:  # posted at the end of the pass whose status said it first
            events = cluster.core.list_namespaced_event(cluster.ns, field_selector="involvedObject.name=node")
            return any(e.reason == "NodeLost" and victim in e.message for e in events.items)

        wait_for(node_lost_event, what="a NodeLost event naming the node", timeout=30)
        st = cluster.wait_phase("node", "Running")
        assert st["restarts"] == 1
        assert {p.spec.node_name for p in cluster.pods("node", "trainer")} <= set(nodes) - {victim}
    finally:
        for n in nodes:
            with contextlib.suppress(client.ApiException):
                cluster.core.delete_node(n)


def test_active_deadline_then_ttl_deletes_the_job(operator, cluster, wait_for):
    cluster.create(manifest("short", runPolicy={"activeDeadlineSeconds": 4, "ttlSecondsAfterFinished": 3}))
    cluster.wait_phase("short", "Failed", timeout=60)
    assert cluster.condition("short", "Failed")["reason"] == "DeadlineExceeded"
    wait_for(lambda: cluster.gone("short"), what="job deleted by its TTL", timeout=60)
    wait_for(lambda: not cluster.children(), what="children collected", timeout=90)


def test_recreated_namesake_is_not_blamed_for_old_pods(operator, cluster, wait_for):
    """Deleting a job and creating one of the same name at once: the old pods, still being
    collected, must not count as failures of the new job's gang."""
    cluster.create(manifest("again"))
    cluster.wait_phase("again", "Running")
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "again")
    wait_for(lambda: cluster.gone("again"), what="old job gone", interval=0.1)
    cluster.create(manifest("again"))
    cluster.wait_phase("again", "Running")
    time.sleep(4)
    assert cluster.status("again").get("restarts", 0) == 0
    assert cluster.status("again")["phase"] == "Running"


def test_kueue_admits_evicts_requeues_and_finishes_a_queued_job(kueue_operator, cluster, fail_pod, wait_for):
    """The operator as Kueue's integration for GRPOJobs: a Workload per labelled job, pods only
    while it is admitted, on the flavor's nodes; after an eviction it stops the pods and hands
    the Workload back to the queue; at the end it marks the Workload Finished."""
    custom, ns = cluster.custom, cluster.ns
    flavor, plain = f"p5-{ns[-6:]}", f"cpu-{ns[-6:]}"
    reserved = {"key": "example.com/reserved", "operator": "Exists", "effect": "NoSchedule"}
    # Kueue reserved the trainer's quota in us-west-2b (one p5 there), not the zone with most p5s.
    p5_in_b = {"nodeLabels": {ZONE_KEY: "us-west-2b"}, "tolerations": [reserved]}
    for name, flavor_spec in ((flavor, p5_in_b), (plain, {})):
        body = {"apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor", "metadata": {"name": name}}
        custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {**body, "spec": flavor_spec})
    gold = {"apiVersion": "/".join(KUEUE), "kind": "WorkloadPriorityClass", "metadata": {"name": flavor}}
    custom.create_cluster_custom_object(*KUEUE, "workloadpriorityclasses", {**gold, "value": 1000})

    def workload() -> dict:
        return custom.get_namespaced_custom_object(*KUEUE, ns, "workloads", "grpojob-queued")

    def write_status(body: dict) -> None:
        custom.patch_namespaced_custom_object_status(
            *KUEUE, ns, "workloads", "grpojob-queued", {"status": body}
        )

    admitted = {
        "admission": {
            "clusterQueue": "p5-gpus",
            "podSetAssignments": [
                {"name": "trainer", "flavors": {"nvidia.com/gpu": flavor}, "count": 1},
                {"name": "rollout", "flavors": {"cpu": plain}, "count": 2},
            ],
        },
        "conditions": [
            condition("QuotaReserved", True, "QuotaReserved", "Quota reserved in ClusterQueue p5-gpus"),
            condition("Admitted", True, "Admitted", "The workload is admitted"),
        ],
    }
    try:
        job = manifest("queued", trainer={"replicas": 1, "instanceType": "p5.48xlarge", "processesPerPod": 8})
        job["metadata"]["labels"] = {
            "kueue.x-k8s.io/queue-name": "team-a",
            "kueue.x-k8s.io/priority-class": flavor,
        }
        cluster.create(job)
        wl = wait_for(workload, what="the job's Workload", ignore=(client.ApiException,))
        assert wl["spec"]["queueName"] == "team-a" and wl["spec"]["priority"] == 1000
        assert wl["spec"]["priorityClassRef"] == {
            "group": "kueue.x-k8s.io",
            "kind": "WorkloadPriorityClass",
            "name": flavor,
        }
        assert [(p["name"], p["count"]) for p in wl["spec"]["podSets"]] == [("trainer", 1), ("rollout", 2)]
        trainer_limits = wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert trainer_limits["nvidia.com/gpu"] == "8" and trainer_limits["vpc.amazonaws.com/efa"] == "32"
        assert wl["metadata"]["ownerReferences"][0]["kind"] == "GRPOJob"
        st = cluster.wait_phase("queued", "Suspended")
        assert "waiting for Kueue to admit it from LocalQueue 'team-a'" in st["message"]
        assert cluster.condition("queued", "Suspended")["reason"] == "AwaitingAdmission"
        assert not cluster.pods("queued", "trainer") and not cluster.pods("queued", "rollout")

        write_status(admitted)  # Kueue admits the whole job
        cluster.wait_phase("queued", "Running")
        (trainer,) = cluster.pods("queued", "trainer")  # the flavor's zone, not the one we would pick
        assert trainer.spec.node_selector[ZONE_KEY] == "us-west-2b" and trainer.spec.node_name == "p5-b-0"
        assert any(t.key == "example.com/reserved" for t in trainer.spec.tolerations)

        preempted = "Preempted to accommodate a workload of higher priority"
        wl = workload()
        write_status(
            {
                "conditions": [
                    *wl["status"]["conditions"],
                    condition("Evicted", True, "Preempted", preempted),
                ]
            }
        )
        st = cluster.wait_phase("queued", "Suspended")
        assert (
            preempted in st["message"]
            and cluster.condition("queued", "Suspended")["reason"] == "EvictedByKueue"
        )
        back = wait_for(
            lambda: (w := workload())["status"].get("admission") is None and w, what="admission cleared"
        )
        kinds = {c["type"]: c for c in back["status"]["conditions"]}
        assert kinds["QuotaReserved"]["status"] == "False" and kinds["Requeued"]["status"] == "True"
        assert not cluster.pods("queued", "trainer")

        evicted_no_more = condition("Evicted", False, "Readmitted", "")
        write_status({**admitted, "conditions": [*admitted["conditions"], evicted_no_more]})
        cluster.wait_phase("queued", "Running")
        cluster.wait_for(lambda: cluster.ready("queued", "trainer", 1), what="trainer ready")
        fail_pod(ns, "queued-trainer-0", exit_code=0, reason="Completed")
        cluster.wait_phase("queued", "Succeeded")
        done = wait_for(
            lambda: next((c for c in workload()["status"]["conditions"] if c["type"] == "Finished"), None),
            what="Workload Finished",
        )
        assert done["status"] == "True" and done["reason"] == "Succeeded"
        assert cluster.status("queued").get("restarts", 0) == 0
    finally:
        for name in (flavor, plain):
            custom.delete_cluster_custom_object(*KUEUE, "resourceflavors", name)
        custom.delete_cluster_custom_object(*KUEUE, "workloadpriorityclasses", flavor)


def test_queue_label_without_kueue_runs_the_job_and_says_it_is_not_queued(operator, cluster, wait_for):
    """An operator started without --kueue cannot hold a labelled job for admission: it runs it,
    and one Warning Event says the label is ignored, instead of a job waiting for nothing."""
    job = manifest("unq")
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    cluster.create(job)
    cluster.wait_phase("unq", "Running")

    def warned() -> list:
        events = cluster.core.list_namespaced_event(
            cluster.ns, field_selector="involvedObject.name=unq"
        ).items
        return [e for e in events if e.reason == "KueueDisabled"]

    (event,) = wait_for(warned, what="KueueDisabled event")
    assert event.type == "Warning" and "runs without --kueue" in event.message


def test_kueue_job_with_an_unknown_priority_class_says_so_and_asks_for_nothing(kueue_operator, cluster):
    job = manifest("nopri")
    job["metadata"]["labels"] = {
        "kueue.x-k8s.io/queue-name": "team-a",
        "kueue.x-k8s.io/priority-class": "nope",
    }
    cluster.create(job)
    st = cluster.wait_phase("nopri", "Suspended")
    assert "WorkloadPriorityClass 'nope' does not exist" in st["message"]
    with pytest.raises(client.ApiException) as missing:
        cluster.custom.get_namespaced_custom_object(*KUEUE, cluster.ns, "workloads", "grpojob-nopri")
    assert missing.value.status == 404
