"""E2E: a job with spec.reward.model (issue 22) under `grpo-operator operator` against the local
control plane (kwok EKS nodes): its reward role's children, readiness in status, a failed reward pod
replaced alone, deletion taking them all, and the role as a Kueue pod set of its own."""

from grpo_operator.api.job import GROUP, PLURAL, VERSION
from kubernetes import client

from tests.support import operator_e2e as e2e
from tests.support.kueue_status import KUEUE, condition
from tests.support.operator_e2e import manifest

crd, operator, cluster, kueue_operator = e2e.crd, e2e.operator, e2e.cluster, e2e.kueue_operator  # by name
ZONE_KEY = "topology.kubernetes.io/zone"

REWARD = {
    "functions": [{"builtin": "math"}],
    "model": {"path": "s3://models/skywork-rm", "instanceType": "p5.48xlarge", "replicas": 1},
}


def test_reward_model_job_gets_its_role_runs_and_replaces_a_failed_reward_pod(
    operator, cluster, fail_pod, wait_for
):
    cluster.create(manifest("rm", reward=REWARD))
    st = cluster.wait_phase("rm", "Running")
    assert st["reward"]["readyText"] == "1/1" and st["reward"]["replicas"] == 1
    assert "1/1 reward model servers ready" in st["message"]
    children = cluster.children()
    for kind in ("statefulset", "service", "networkpolicy", "poddisruptionbudget", "serviceaccount"):
        assert any(c.endswith("/rm-reward") and c.startswith(kind) for c in children), (kind, children)
    sts = cluster.apps.read_namespaced_stateful_set("rm-reward", cluster.ns)
    assert sts.spec.replicas == 1 and sts.spec.update_strategy.type == "RollingUpdate"
    (pod,) = cluster.pods("rm", "reward")
    (main,) = pod.spec.containers
    assert main.command == ["python", "-m", "grpo_rollout", "reward"]
    assert main.resources.limits == {"nvidia.com/gpu": "1"}  # one GPU, no EFA
    assert pod.spec.node_selector["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    policy = cluster.kubectl("get", "networkpolicy", "rm-reward", "-n", cluster.ns, "-o", "json").stdout
    assert '"grpo.dev/role": "rollout"' in policy and '"port": 8100' in policy
    wide = cluster.kubectl("get", "grpojob", "rm", "-n", cluster.ns, "-o", "wide").stdout
    assert "REWARDMODELS" in wide.splitlines()[0] and "1/1" in wide.splitlines()[1]

    trainers, rollouts = cluster.uids("rm", "trainer"), cluster.uids("rm", "rollout")
    old = cluster.uids("rm", "reward")["rm-reward-0"]
    fail_pod(cluster.ns, "rm-reward-0", exit_code=1)
    wait_for(
        lambda: cluster.uids("rm", "reward").get("rm-reward-0") not in (None, old),
        what="rm-reward-0 replaced",
        timeout=120,
    )
    wait_for(lambda: cluster.ready("rm", "reward", 1), what="the new reward pod ready", timeout=90)
    assert cluster.uids("rm", "trainer") == trainers and cluster.uids("rm", "rollout") == rollouts
    st = cluster.wait_phase("rm", "Running")
    assert st.get("restarts", 0) == 0 and st["reward"]["readyText"] == "1/1"

    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "rm")
    wait_for(lambda: not cluster.children(), what="no children", timeout=90)
    wait_for(lambda: not cluster.core.list_namespaced_pod(cluster.ns).items, what="no pods", timeout=90)


def test_a_reward_server_that_states_a_misconfiguration_fails_the_job_naming_the_field(
    operator, cluster, fail_pod, wait_for
):
    """The reward pod's termination message (exit 3, as `grpo_rollout reward` writes it) is the job's
    Failed condition at once: no replacement pod would load the model any better."""
    cluster.create(manifest("rmbad", reward=REWARD))
    cluster.wait_phase("rmbad", "Running")
    stated = (
        "RewardModelMisconfigured: rmbad-reward-0: spec.reward.model.path 's3://models/skywork-rm' is a "
        "classifier with 2 outputs (labels ['NEGATIVE', 'POSITIVE']); a reward model has one (num_labels 1)"
    )
    fail_pod(cluster.ns, "rmbad-reward-0", exit_code=3, message=stated)
    st = cluster.wait_phase("rmbad", "Failed")
    failed = cluster.condition("rmbad", "Failed")
    assert failed["reason"] == "RewardModelMisconfigured", failed
    assert "rmbad-reward-0" in failed["message"] and "is a classifier with 2 outputs" in failed["message"]
    assert st.get("restarts", 0) == 0  # the trainer gang was never restarted for it
    wait_for(
        lambda: cluster.apps.read_namespaced_stateful_set("rmbad-reward", cluster.ns).spec.replicas == 0,
        what="the reward servers scaled to zero",
        timeout=60,
    )


def test_a_job_without_a_reward_model_has_no_reward_role(operator, cluster):
    cluster.create(manifest("plain"))
    st = cluster.wait_phase("plain", "Running")
    assert "reward" not in st
    assert not [c for c in cluster.children() if "reward" in c]


def test_kueue_queued_reward_model_job_has_a_reward_pod_set_placed_and_evicted_with_it(
    kueue_operator, cluster, wait_for
):
    """A queued job with spec.reward.model asks Kueue for a reward pod set (one GPU a server, no
    EFA), starts no reward pod before admission, puts the reward pods on the flavor Kueue assigned
    that pod set, and stops them with the rest of the job when Kueue evicts it."""
    custom, ns = cluster.custom, cluster.ns
    gpu_a, gpu_b, plain = (f"{kind}-{ns[-6:]}" for kind in ("p5a", "p5b", "cpu"))
    reserved = {"key": "example.com/reserved", "operator": "Exists", "effect": "NoSchedule"}
    # Kueue reserved the trainer's p5 in us-west-2a and the reward server's GPU on the one p5 in
    # us-west-2b (with a toleration the trainer's flavor lacks): each pod must follow its own pod set's.
    flavors = {
        gpu_a: {"nodeLabels": {ZONE_KEY: "us-west-2a"}},
        gpu_b: {"nodeLabels": {ZONE_KEY: "us-west-2b"}, "tolerations": [reserved]},
        plain: {},
    }
    for name, spec in flavors.items():
        body = {"apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor", "metadata": {"name": name}}
        custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {**body, "spec": spec})

    def workload() -> dict:
        return custom.get_namespaced_custom_object(*KUEUE, ns, "workloads", "grpojob-rmq")

    def write_status(body: dict) -> None:
        custom.patch_namespaced_custom_object_status(*KUEUE, ns, "workloads", "grpojob-rmq", {"status": body})

    try:
        job = manifest(
            "rmq",
            trainer={"replicas": 1, "instanceType": "p5.48xlarge", "processesPerPod": 8},
            reward=REWARD,
        )
        job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
        cluster.create(job)
        wl = wait_for(workload, what="the job's Workload", ignore=(client.ApiException,), timeout=30)
        pod_sets = wl["spec"]["podSets"]
        assert [(p["name"], p["count"]) for p in pod_sets] == [("trainer", 1), ("rollout", 2), ("reward", 1)]
        (reward_main,) = pod_sets[2]["template"]["spec"]["containers"]
        assert reward_main["resources"]["limits"] == {"nvidia.com/gpu": "1"}  # one GPU, no EFA
        st = cluster.wait_phase("rmq", "Suspended", timeout=30)
        assert cluster.condition("rmq", "Suspended")["reason"] == "AwaitingAdmission", st
        for role in ("trainer", "rollout", "reward"):
            assert not cluster.pods("rmq", role), role

        write_status(
            {
                "admission": {
                    "clusterQueue": "p5-gpus",
                    "podSetAssignments": [
                        {"name": "trainer", "flavors": {"nvidia.com/gpu": gpu_a}, "count": 1},
                        {"name": "rollout", "flavors": {"cpu": plain}, "count": 2},
                        {"name": "reward", "flavors": {"nvidia.com/gpu": gpu_b}, "count": 1},
                    ],
                },
                "conditions": [
                    condition(
                        "QuotaReserved", True, "QuotaReserved", "Quota reserved in ClusterQueue p5-gpus"
                    ),
                    condition("Admitted", True, "Admitted", "The workload is admitted"),
                ],
            }
        )
        st = wait_for(
            lambda: (
                (s := cluster.status("rmq")).get("phase") == "Running"
                and (s.get("reward") or {}).get("readyText") == "1/1"
                and s
            ),
            what="rmq Running with 1/1 reward model servers ready",
            timeout=60,
        )
        (reward,) = cluster.pods("rmq", "reward")
        assert reward.spec.node_selector[ZONE_KEY] == "us-west-2b" and reward.spec.node_name == "p5-b-0"
        assert any(t.key == "example.com/reserved" for t in reward.spec.tolerations)
        (trainer,) = cluster.pods("rmq", "trainer")
        assert trainer.spec.node_selector[ZONE_KEY] == "us-west-2a"
        assert not any(t.key == "example.com/reserved" for t in trainer.spec.tolerations)

        preempted = "Preempted to accommodate a workload of higher priority"
        evicted = condition("Evicted", True, "Preempted", preempted)
        write_status({"conditions": [*workload()["status"]["conditions"], evicted]})
        st = cluster.wait_phase("rmq", "Suspended", timeout=30)
        assert preempted in st["message"]
        assert cluster.condition("rmq", "Suspended")["reason"] == "EvictedByKueue"
        wait_for(
            lambda: cluster.apps.read_namespaced_stateful_set("rmq-reward", ns).spec.replicas == 0,
            what="rmq-reward scaled to 0",
            timeout=30,
        )
        for role in ("trainer", "rollout", "reward"):
            wait_for(lambda role=role: not cluster.pods("rmq", role), what=f"no {role} pods", timeout=30)
        # The quota is handed back only once every pod, the reward servers' too, is gone.
        wait_for(lambda: workload()["status"].get("admission") is None, what="admission cleared", timeout=30)
    finally:
        for name in flavors:
            custom.delete_cluster_custom_object(*KUEUE, "resourceflavors", name)
