"""E2E: a job with spec.reward.model (issue 22) under `grpo-operator operator` against the local
control plane (kwok EKS nodes): its reward role's children, readiness in status, a failed reward pod
replaced alone, and deletion taking them all."""

from grpo_operator.api.job import GROUP, PLURAL, VERSION

from tests.support import operator_e2e as e2e
from tests.support.operator_e2e import manifest

crd, operator, cluster = e2e.crd, e2e.operator, e2e.cluster  # the fixtures, by name

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


def test_a_job_without_a_reward_model_has_no_reward_role(operator, cluster):
    cluster.create(manifest("plain"))
    st = cluster.wait_phase("plain", "Running")
    assert "reward" not in st
    assert not [c for c in cluster.children() if "reward" in c]
