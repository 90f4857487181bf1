"""The reward role (spec.reward.model) as the operator renders and runs it: its children, pods,
contract, Kueue pod set, and its place in the lifecycle (status.reward, readiness, failed pods)."""

from types import SimpleNamespace

import pytest
from grpo_operator import render
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import GRPOJobStatus, Phase
from grpo_operator.controller import observe, reconcile
from grpo_operator.controller.queueing import Queueing, pod_counts
from grpo_operator.render import names

from tests.support.render import by_kind, container, env, job, rendered
from tests.support.status import all_ready, decide, pod, spec

REWARD = {"path": "pvc://models/skywork-rm", "instanceType": "p5.48xlarge", "replicas": 2}


def reward_job(**model):
    return job(reward__model={**REWARD, **model})


def kinds(r: render.Rendered) -> list[tuple[str, str]]:
    return [(c["kind"], c["metadata"]["name"]) for c in r.children]


def test_children_only_with_a_reward_model():
    plain, served = kinds(rendered()), kinds(rendered(reward_job()))
    assert not [n for _, n in plain if "reward" in n]
    assert set(served) - set(plain) == {
        ("ServiceAccount", "moe-reward"),
        ("NetworkPolicy", "moe-reward"),
        ("Service", "moe-reward"),
        ("StatefulSet", "moe-reward"),
        ("PodDisruptionBudget", "moe-reward"),
    }
    assert rendered().contract.reward is None


def test_statefulset_service_and_budget():
    r = rendered(reward_job())
    sts = by_kind(r, "StatefulSet", "moe-reward")["spec"]
    assert sts["replicas"] == 2 and sts["podManagementPolicy"] == "Parallel"
    assert sts["updateStrategy"] == {"type": "RollingUpdate"} and sts["serviceName"] == "moe-reward"
    assert sts["selector"]["matchLabels"] == names.selector("moe", names.ROLE_REWARD)
    assert (
        by_kind(rendered(reward_job(), running=False), "StatefulSet", "moe-reward")["spec"]["replicas"] == 0
    )
    svc = by_kind(r, "Service", "moe-reward")["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is False
    assert svc["ports"] == [{"name": "http", "port": 8100, "targetPort": 8100, "protocol": "TCP"}]
    pdb = by_kind(r, "PodDisruptionBudget", "moe-reward")["spec"]
    assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb
    sa = by_kind(rendered(reward_job(serviceAccountAnnotations={"eks.amazonaws.com/role-arn": "arn:rm"})),
                 "ServiceAccount", "moe-reward")  # fmt: skip
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:rm"}


def test_only_this_jobs_rollout_pods_reach_the_reward_port():
    policy = by_kind(rendered(reward_job()), "NetworkPolicy", "moe-reward")["spec"]
    assert policy["podSelector"]["matchLabels"] == names.isolation_selector("moe", "uid-1", names.ROLE_REWARD)
    (rule,) = policy["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": names.isolation_selector("moe", "uid-1", "rollout")}}
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8100}]
    scrape = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    policy = by_kind(rendered(reward_job(), metrics_from=scrape), "NetworkPolicy", "moe-reward")["spec"]
    assert policy["ingress"][1] == {"from": scrape, "ports": [{"protocol": "TCP", "port": 8100}]}


def test_pod_one_gpu_no_efa_on_p5_and_none_on_cpu():
    r = rendered(reward_job())
    c = container(r, "reward")
    assert c["command"] == ["python", "-m", "grpo_rollout", "reward"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"} == c["resources"]["requests"]
    assert c["ports"] == [{"name": "http", "containerPort": 8100, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "securityContext" not in c  # no IPC_LOCK: no EFA
    e = env(c)
    assert {"GRPO_CONTRACT", "GRPO_POD_INDEX", "GRPO_TOKEN"} <= set(e) and "FI_PROVIDER" not in e
    assert e["GRPO_TOKEN"]["secretKeyRef"]["name"] == names.token_secret("moe", "uid-1")
    pod_spec = by_kind(r, "StatefulSet", "moe-reward")["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert (
        pod_spec["serviceAccountName"] == "moe-reward" and pod_spec["automountServiceAccountToken"] is False
    )
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/mnt/pvc/models" in mounts  # reward.model.path's claim
    labels = by_kind(r, "StatefulSet", "moe-reward")["spec"]["template"]["metadata"]["labels"]
    assert labels[names.LABEL_JOB_UID] == "uid-1" and labels[names.LABEL_ROLE] == "reward"
    cpu = container(rendered(job(reward__model={"path": "/models/rm"})), "reward")
    assert "nvidia.com/gpu" not in str(cpu["resources"]) and "vpc.amazonaws.com/efa" not in str(
        cpu["resources"]
    )


def test_a_vllm_reward_server_gets_its_tensor_parallel_gpus_and_still_no_efa():
    tp = reward_job(engine="vllm", tensorParallelSize=4)
    c = container(rendered(tp), "reward")
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "4"} == c["resources"]["requests"]
    assert "FI_PROVIDER" not in env(c)
    refused = reward_job(engine="vllm", tensorParallelSize=2, instanceType="g5.xlarge")
    with pytest.raises(
        render.RenderError, match=r"tensorParallelSize 2 exceeds the 1 GPU\(s\) of g5\.xlarge"
    ):
        rendered(refused)


def test_template_override_is_merged_under_its_field_path():
    tpl = {"spec": {"containers": [{"name": "reward", "image": "evil:1"}], "nodeSelector": {"pool": "rm"}}}
    r = rendered(reward_job(template=tpl))
    pod_spec = by_kind(r, "StatefulSet", "moe-reward")["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"]["pool"] == "rm"
    assert any("reward.model.template" in w for w in r.warnings)  # the operator's image kept


def test_contract_lists_the_reward_servers():
    r = rendered(reward_job())
    reward = r.contract.reward
    assert reward.service == "moe-reward.team.svc" and reward.port == 8100 and reward.replicas == 2
    assert reward.endpoints == [f"http://moe-reward-{i}.moe-reward.team.svc:8100" for i in range(2)]
    assert r.contract.spec.reward.model.path == "/mnt/pvc/models/skywork-rm"  # pvc:// resolved
    ports = render.LocalPorts(trainer_master_port=1, rollout_ports=(2, 3), reward_ports=(4, 5))
    local = render.contract(reward_job(), name="moe", namespace="local", local_ports=ports)
    assert local.reward.endpoints == ["http://127.0.0.1:4", "http://127.0.0.1:5"]
    with pytest.raises(render.RenderError, match="reward ports"):
        render.contract(reward_job(), name="moe", namespace="local", local_ports=ports.__class__(1, (2, 3)))


def test_kueue_pod_set_only_with_a_reward_model():
    assert names.ROLE_REWARD not in pod_counts(job().spec)
    assert pod_counts(reward_job().spec)[names.ROLE_REWARD] == 2
    body = {"metadata": {"name": "moe", "namespace": "team", "uid": "uid-1"}}
    for j, sets in ((job(), ["trainer", "rollout"]), (reward_job(), ["trainer", "rollout", "reward"])):
        wl = Queueing._workload(body, rendered(j), "q", pod_counts(j.spec), None)
        assert [ps["name"] for ps in wl["spec"]["podSets"]] == sets
    wl = Queueing._workload(body, rendered(reward_job()), "q", pod_counts(reward_job().spec), None)
    reward_set = wl["spec"]["podSets"][2]
    limits = reward_set["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert reward_set["count"] == 2 and limits == {"nvidia.com/gpu": "1"}


def reward_spec(replicas: int = 1) -> GRPOJobSpec:
    """The lifecycle tests' spec (two trainer pods, two rollout servers) with reward model servers."""
    raw = spec().model_dump(by_alias=True, exclude_none=True)
    raw["reward"]["model"] = {"path": "/rm", "replicas": replicas}
    return GRPOJobSpec.model_validate(raw)


def test_status_reward_and_running_needs_a_ready_reward_server():
    s = reward_spec()
    waiting = decide([*all_ready(), pod("reward", 0, ready=False)], s=s)
    assert waiting.status.phase == Phase.STARTING and waiting.status.reward.ready_text == "0/1"
    assert "reward 0/1 ready" in waiting.status.message
    up = decide([*all_ready(), pod("reward", 0)], s=s, old=waiting.status)
    assert up.status.phase == Phase.RUNNING and up.status.reward.ready_text == "1/1"
    assert up.status.rollout.ready == 2  # reward pods are not counted as rollout servers
    assert decide(all_ready()).status.reward is None  # no reward model: no status.reward


def test_failed_reward_pod_is_deleted_without_a_gang_restart():
    s = reward_spec()
    running = decide([*all_ready(), pod("reward", 0)], s=s).status
    pods = [*all_ready(), pod("reward", 0, phase="Failed", term=1, ready=False)]
    obs = observe.summarize(pods, attempt=0)
    assert obs.failed_reward_pods == ["j-reward-0"] and obs.failed_rollout_pods == []
    d = decide(pods, s=s, old=running)
    assert not d.gang_restart and d.running and d.status.restarts == 0
    deleted = []
    kube = SimpleNamespace(delete_pod=lambda ns, name, **kw: deleted.append(name))
    rec = reconcile.Reconciler(kube, table=None)
    rec._delete_stale("ml", pods, d, obs)
    assert deleted == ["j-reward-0"]


def test_a_reward_server_stating_a_misconfiguration_fails_the_job_with_its_words():
    """Exit 3 (EXIT_CONFIG) from `grpo_rollout reward`: no restart fixes a classifier with two outputs,
    and the rollout servers would only see it unreachable; the job fails at once, naming the field."""
    s = reward_spec()
    running = decide([*all_ready(), pod("reward", 0)], s=s).status
    crashed = pod("reward", 0, ready=False)
    stated = (
        "RewardModelMisconfigured: j-reward-0: spec.reward.model.path '/models/rm' is a classifier with 2 "
        "outputs (labels ['NEGATIVE', 'POSITIVE']); a reward model has one (num_labels 1)"
    )
    crashed["status"]["containerStatuses"] = [  # restarting: the last run's record
        {"name": "reward", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
         "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": stated}}}
    ]  # fmt: skip
    d = decide([*all_ready(), crashed], s=s, old=running)
    failed = next(c for c in d.status.conditions if c.type == "Failed")
    assert (d.status.phase, failed.reason, d.running) == (Phase.FAILED, "RewardModelMisconfigured", False)
    assert failed.message.startswith(
        "reward model server j-reward-0 cannot serve as configured: j-reward-0: "
    )
    assert "spec.reward.model.path '/models/rm' is a classifier with 2 outputs" in failed.message
    gone = "PathNotFound: j-reward-0: spec.reward.model.path s3://models/rm: does not exist"
    crashed["status"]["containerStatuses"][0]["lastState"]["terminated"]["message"] = gone
    missing = decide([*all_ready(), crashed], s=s, old=running)
    failed = next(c for c in missing.status.conditions if c.type == "Failed")
    assert (failed.reason, missing.running) == ("PathNotFound", False)  # the reason the pod stated
    assert failed.message.endswith("j-reward-0: spec.reward.model.path s3://models/rm: does not exist")
    crashed["status"]["containerStatuses"][0]["lastState"]["terminated"] |= {"exitCode": 1, "message": "OOM"}
    other = decide([*all_ready(), crashed], s=s, old=running)  # any other exit: replaced alone
    assert other.running and other.status.phase != Phase.FAILED and not other.gang_restart


def test_a_stopped_job_scales_the_reward_servers_too():
    assert ("apps/v1", "StatefulSet", names.ROLE_REWARD) in reconcile.STOPPABLE
    assert GRPOJobStatus.model_fields["reward"].default is None


def test_an_unknown_reward_instance_type_names_its_field():
    with pytest.raises(render.RenderError, match=r"^reward\.model\.instanceType: "):
        rendered(reward_job(instanceType="p9.imaginary"))


def test_a_reward_model_removed_from_a_live_job_stops_its_servers_once():
    scaled = []
    kube = SimpleNamespace(scale=lambda *args: scaled.append(args))
    rec = reconcile.Reconciler(kube, table=None)
    meta = {"name": "moe", "namespace": "team"}
    had = GRPOJobStatus.model_validate({"reward": {"replicas": 2, "ready": 2, "readyText": "2/2"}})
    rec._stop_removed_reward(meta, had, job())
    assert scaled == [("apps/v1", "StatefulSet", "team", "moe-reward", 0)]
    rec._stop_removed_reward(meta, GRPOJobStatus(), job())  # status.reward cleared: nothing more
    rec._stop_removed_reward(meta, had, reward_job())  # still served: nothing
    assert len(scaled) == 1
