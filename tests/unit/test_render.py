"""Unit tests of grpo_operator.render: contract topology, children, EFA-aware pods."""

import pytest
from grpo_operator import instance_types, render
from grpo_operator.render import names

from tests.support.render import by_kind, container, env, job, rendered


def test_contract_topology_uses_service_dns_and_ep_layout():
    c = render.contract(job(), name="moe", namespace="team", generation=4)
    assert c.generation == 4
    assert (
        c.trainer.world_size == 16
        and c.trainer.expert_parallel_size == 16
        and c.trainer.data_parallel_size == 1
    )
    assert c.trainer.master_addr == "moe-trainer-0.moe-trainer.team.svc"
    assert c.trainer.backend == "nccl"
    assert c.rollout.endpoints == [
        "http://moe-rollout-0.moe-rollout.team.svc:8000",
        "http://moe-rollout-1.moe-rollout.team.svc:8000",
    ]
    assert c.spec.model.path == "/mnt/pvc/models/qwen3-moe"
    assert c.spec.dataset.path == "s3://bucket/gsm8k.jsonl"
    assert c.checkpoint_dir == "/mnt/pvc/ckpt/runs/team/moe"
    assert c.status_url.endswith("/namespaces/team/grpojobs/moe/status")


def test_contract_with_local_ports_uses_loopback():
    j = job(trainer={"replicas": 1, "processesPerPod": 2}, rollout={"replicas": 2})
    c = render.contract(
        j, name="tiny", namespace="default", local_ports=render.LocalPorts(29999, (8101, 8102))
    )
    assert (c.trainer.master_addr, c.trainer.master_port) == ("127.0.0.1", 29999)
    assert c.rollout.endpoints == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert c.trainer.backend == "gloo" and c.trainer.world_size == 2
    assert c.spec.model.path == "pvc://models/qwen3-moe"  # nothing is mounted locally
    with pytest.raises(render.RenderError, match="1 rollout ports for 2"):
        render.contract(j, name="tiny", namespace="default", local_ports=render.LocalPorts(1, (2,)))


def test_all_children_exist_with_owner_references():
    r = rendered()
    kinds = sorted((c["kind"], c["metadata"]["name"]) for c in r.children)
    assert kinds == sorted(
        [
            ("ConfigMap", "moe-contract"),
            ("ServiceAccount", "moe-trainer"),
            ("ServiceAccount", "moe-rollout"),
            ("Role", "moe-trainer"),
            ("RoleBinding", "moe-trainer"),
            ("Service", "moe-trainer"),
            ("Service", "moe-rollout"),
            ("StatefulSet", "moe-trainer"),
            ("StatefulSet", "moe-rollout"),
            ("PodDisruptionBudget", "moe-trainer"),
            ("NetworkPolicy", "moe-trainer"),
            ("NetworkPolicy", "moe-rollout"),
        ]
    )
    for c in r.children:
        assert c["metadata"]["namespace"] == "team"
        assert c["metadata"]["ownerReferences"] == [names.owner_reference("moe", "uid-1")]
    assert (
        render.contract(job(), name="moe", namespace="team", uid="uid-1").model_dump_json(
            by_alias=True, exclude_none=True, indent=2
        )
        == by_kind(r, "ConfigMap")["data"]["job.json"]
    )


def test_role_is_scoped_by_resource_names():
    rules = by_kind(rendered(), "Role")["rules"]
    # EndpointSlice names are generated: rank 0 lists them (read only) to follow the rollout servers
    slices = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}
    assert slices in rules
    assert all(rule["resourceNames"] for rule in rules if rule != slices)
    assert {"grpojobs/status"} <= {res for rule in rules for res in rule["resources"]}


def test_trainer_statefulset_is_a_parallel_on_delete_gang():
    sts = by_kind(rendered(attempt=3), "StatefulSet", "moe-trainer")
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["template"]["metadata"]["labels"][names.LABEL_ATTEMPT] == "3"
    assert by_kind(rendered(), "Service", "moe-trainer")["spec"]["publishNotReadyAddresses"] is True


def test_not_running_scales_both_statefulsets_to_zero():
    r = rendered(running=False)
    assert [c["spec"]["replicas"] for c in r.children if c["kind"] == "StatefulSet"] == [0, 0]


def test_the_rollout_count_of_the_pass_sizes_the_statefulset_and_the_contract_endpoints():
    r = rendered(rollout_replicas=5)  # autoscaled (or Kueue-capped) above the spec's count
    assert by_kind(r, "StatefulSet", "moe-rollout")["spec"]["replicas"] == 5
    assert r.contract.rollout.replicas == 5 and len(r.contract.rollout.endpoints) == 5
    assert r.contract.rollout.endpoints[4].startswith("http://moe-rollout-4.")


def test_commands_and_per_pod_env():
    r = rendered()
    t, ro = container(r, "trainer"), container(r, "rollout")
    assert t["command"] == ["python", "-m", "grpo_trainer", "train"]
    assert ro["command"] == ["python", "-m", "grpo_rollout", "serve"]
    e = env(t)
    assert e["GRPO_CONTRACT"] == "/etc/grpo/job.json"
    assert e["GRPO_POD_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    assert e["GRPO_TOKEN"] == {"secretKeyRef": {"name": "moe-token-uid-1", "key": "token"}}


def test_p5_trainer_requests_whole_node_with_efa():
    r = rendered()
    t = container(r, "trainer")
    assert t["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert t["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"
    assert t["resources"]["requests"]["hugepages-2Mi"] == "5120Mi"
    assert t["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    e = env(t)
    assert e["FI_PROVIDER"] == "efa" and e["FI_EFA_USE_DEVICE_RDMA"] == "1" and e["FI_EFA_FORK_SAFE"] == "1"
    # DeepEP v2 over NCCL GIN (proxy type, any EFA instance); never NVSHMEM/IBGDA on EFA
    assert e["NCCL_GIN_TYPE"] == "2" and e["NCCL_NET_PLUGIN"] == e["NCCL_GIN_PLUGIN"] == "ofi"
    assert not [k for k in e if "NVSHMEM" in k or "IBGDA" in k or "GDAKI" in k]
    pod = by_kind(r, "StatefulSet", "moe-trainer")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    aff = pod["affinity"]["podAffinity"]
    assert (
        aff["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"]
        == "topology.kubernetes.io/zone"
    )
    keys = [
        t["podAffinityTerm"]["topologyKey"] for t in aff["preferredDuringSchedulingIgnoredDuringExecution"]
    ]
    assert keys[0] == "topology.k8s.aws/network-node-layer-3"
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory"}
    assert {"name": "pvc-ckpt", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["volumes"]


def test_a_vllm_server_holds_tensor_times_data_parallel_gpus():
    rollout = {"replicas": 1, "instanceType": "p5.48xlarge", "tensorParallelSize": 2}
    r = rendered(job(rollout={**rollout, "vllm": {"dataParallelSize": 4, "expertParallelSize": 8}}))
    assert container(r, "rollout")["resources"]["limits"]["nvidia.com/gpu"] == "8"
    with pytest.raises(render.RenderError, match=r"tensorParallelSize x vllm.dataParallelSize = 16 exceeds"):
        rendered(job(rollout={**rollout, "tensorParallelSize": 4, "vllm": {"dataParallelSize": 4}}))


def test_p5en_has_sixteen_efa_devices():
    t = container(rendered(job(trainer__instanceType="p5en.48xlarge")), "trainer")
    assert t["resources"]["limits"]["vpc.amazonaws.com/efa"] == "16"


def test_efa_disabled_renders_plain_gpu_pods():
    t = container(rendered(job(network={"efa": "disabled"})), "trainer")
    assert t["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert "securityContext" not in t
    assert "FI_PROVIDER" not in env(t)


def test_efa_required_without_efa_is_a_clear_error():
    j = job(trainer={"instanceType": "g5.xlarge", "processesPerPod": 1}, network={"efa": "required"})
    with pytest.raises(render.RenderError, match=r"'g5\.xlarge' has no EFA devices"):
        rendered(j)


def test_unknown_instance_type_is_a_clear_error():
    with pytest.raises(render.RenderError, match=r"trainer.instanceType: unknown instance type 'p9.bogus'"):
        rendered(job(trainer__instanceType="p9.bogus"))


def test_cpu_job_has_no_devices_and_no_gang_affinity():
    j = job(trainer={"replicas": 1, "processesPerPod": 2}, rollout={"replicas": 1, "engine": "torch"})
    r = rendered(j)
    t = container(r, "trainer")
    assert "resources" not in t or "nvidia.com/gpu" not in t["resources"].get("limits", {})
    assert "affinity" not in by_kind(r, "StatefulSet", "moe-trainer")["spec"]["template"]["spec"]


def test_instance_table_override_adds_a_type(tmp_path):
    f = tmp_path / "types.yaml"
    f.write_text("p7.future: {gpus: 8, efa: 64}\np5.48xlarge: {efa: 30}\n")
    table = instance_types.load(f)
    t = container(rendered(job(trainer__instanceType="p7.future"), instance_types=table), "trainer")
    assert t["resources"]["limits"]["vpc.amazonaws.com/efa"] == "64"
    assert table.get("p5.48xlarge").efa == 30 and table.get("p5.48xlarge").gpus == 8
    with pytest.raises(ValueError, match="needs both"):
        instance_types.BUILTIN.merged({"x1": {"gpus": 1}})


def test_pod_group_for_volcano():
    r = rendered(job(scheduling={"podGroup": "volcano", "queue": "gpu"}))
    pg = by_kind(r, "PodGroup")
    assert pg["spec"] == {"minMember": 2, "queue": "gpu"}
    tpl = by_kind(r, "StatefulSet", "moe-trainer")["spec"]["template"]
    assert tpl["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "moe-trainer"
    assert tpl["spec"]["schedulerName"] == "volcano"


def test_long_names_are_refused():
    with pytest.raises(render.RenderError, match="at most 44"):
        render.render(job(), name="x" * 45, namespace="team", uid="u")


def test_render_is_deterministic():
    assert rendered().children == rendered().children


def test_zone_pins_the_trainer_gang_only():
    r = rendered(zone="us-west-2a")
    trainer = by_kind(r, "StatefulSet", "moe-trainer")["spec"]["template"]["spec"]["nodeSelector"]
    rollout = by_kind(r, "StatefulSet", "moe-rollout")["spec"]["template"]["spec"]["nodeSelector"]
    assert trainer["topology.kubernetes.io/zone"] == "us-west-2a"
    assert "topology.kubernetes.io/zone" not in rollout


def test_a_new_attempt_is_kept_off_the_nodes_seen_lost_and_keeps_its_gang_affinity():
    """A scheduler whose cache still lists a node just deleted bound a new attempt's rank there
    (seen on the e2e fleet): the lost node took a second gang restart. By name, required."""
    spec = by_kind(rendered(avoid_nodes=("p5-a", "p5-b")), "StatefulSet", "moe-trainer")["spec"]
    affinity = spec["template"]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [
        {
            "matchFields": [
                {"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("p5-a", "p5-b")
            ]
        }
    ]
    assert "podAffinity" in affinity  # the one-zone gang rule stays
    rollout = by_kind(rendered(avoid_nodes=("p5-a",)), "StatefulSet", "moe-rollout")["spec"]["template"]
    assert "nodeAffinity" not in (rollout["spec"].get("affinity") or {})
    assert "nodeAffinity" not in (
        by_kind(rendered(), "StatefulSet", "moe-trainer")["spec"]["template"]["spec"]["affinity"] or {}
    )


@pytest.mark.parametrize(
    ("ep_backend", "trainer_type", "runs"),
    [
        ("gloo", "p5.48xlarge", "nccl"),
        ("nccl", "m7i.8xlarge", "gloo"),
        ("nccl", None, "gloo"),
        ("deepep", "m7i.8xlarge", "gloo"),  # CEL sees an instanceType; the table says it has no GPUs
    ],
)
def test_an_all_to_all_ep_backend_of_the_other_device_is_refused_naming_the_field(
    ep_backend: str, trainer_type: str | None, runs: str
) -> None:
    trainer = {"replicas": 1, "processesPerPod": 8, "expertParallelSize": 8}
    trainer |= {"instanceType": trainer_type} if trainer_type else {}
    with pytest.raises(render.RenderError, match=f"trainer.epBackend {ep_backend} .* this gang runs {runs}"):
        rendered(job(trainer=trainer | {"epBackend": ep_backend}))
    rendered(job(trainer=trainer | {"epBackend": runs}))
