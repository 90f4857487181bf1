"""Every file under examples/ (and the Argo CD Applications) is checked here.

GRPOJobs pass `grpo-operator validate` and render; the EKS infrastructure examples (eksctl,
Karpenter, Kueue, FSx) agree with what the renderer asks of nodes: instance types it knows,
one Availability Zone for EFA, taints its pods tolerate, queue resources its pods request,
claims its `pvc://` paths name. The e2e ring adds a server-side dry-run of the same files.
"""

import fnmatch
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.roles import RolloutSpec
from grpo_operator.instance_types import EFA_RESOURCE, GPU_RESOURCE, INSTANCE_TYPE_LABEL
from grpo_operator.instance_types import load as load_instance_types
from grpo_operator.render import names, render, storage

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FILES = sorted(p for p in EXAMPLES.rglob("*.yaml") if not any(part.startswith(".") for part in p.parts))
KNOWN_KINDS = {
    ("grpo.dev/v1alpha1", "GRPOJob"),
    ("eksctl.io/v1alpha5", "ClusterConfig"),
    ("karpenter.sh/v1", "NodePool"),
    ("karpenter.k8s.aws/v1", "EC2NodeClass"),
    ("kueue.x-k8s.io/v1beta2", "ResourceFlavor"),
    ("kueue.x-k8s.io/v1beta2", "ClusterQueue"),
    ("kueue.x-k8s.io/v1beta2", "LocalQueue"),
    ("kueue.x-k8s.io/v1beta2", "WorkloadPriorityClass"),
    ("v1", "PersistentVolume"),
    ("v1", "PersistentVolumeClaim"),
}
TABLE = load_instance_types()


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


ALL = [(p, d) for p in FILES for d in docs(p)]
JOBS = [(p, d) for p, d in ALL if d["kind"] == "GRPOJob"]
GPU_JOBS = [(p, d) for p, d in JOBS if d["spec"].get("trainer", {}).get("instanceType")]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in ALL if d["kind"] == kind]


def rendered_pods(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod spec per role (trainer, rollout) as the operator renders them."""
    name = job["metadata"]["name"]
    out = render(GRPOJob.model_validate(job), name=name, namespace="ml", uid="uid-1")
    return {
        c["metadata"]["name"].removeprefix(f"{name}-"): c["spec"]["template"]["spec"]
        for c in out.children
        if c["kind"] == "StatefulSet"
    }


def tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    """Kubernetes' toleration semantics (core/v1 Toleration.ToleratesTaint)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists":
            if not t.get("key") or t["key"] == taint["key"]:
                return True
        elif t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def test_every_example_is_a_known_kind() -> None:
    assert len(FILES) >= 8
    for path, doc in ALL:
        assert (doc["apiVersion"], doc["kind"]) in KNOWN_KINDS, f"{path}: untested kind {doc['kind']}"


def test_grpo_operator_validate_accepts_every_example() -> None:
    job_files = sorted({str(p) for p, _ in JOBS})
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_operator.cli", "validate", *job_files],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": valid") == len(job_files)


@pytest.mark.parametrize(("path", "job"), GPU_JOBS, ids=[d["metadata"]["name"] for _, d in GPU_JOBS])
def test_gpu_examples_render_whole_efa_nodes(path: Path, job: dict[str, Any]) -> None:
    trainer_spec = GRPOJob.model_validate(job).spec.trainer
    itype = TABLE.get(trainer_spec.instance_type)
    pods = rendered_pods(job)
    limits = pods[names.ROLE_TRAINER]["containers"][0]["resources"]["limits"]
    assert limits[GPU_RESOURCE] == str(itype.gpus) == str(trainer_spec.processes_per_pod)
    assert limits[EFA_RESOURCE] == str(itype.efa), f"{path}: trainers take every EFA device of the node"
    assert pods[names.ROLE_TRAINER]["nodeSelector"][INSTANCE_TYPE_LABEL] == itype.name


MINE = [p for p in FILES if p.name.startswith(("p5", "kueue"))]


@pytest.mark.parametrize("path", MINE, ids=lambda p: p.name)
def test_vllm_rollouts_use_the_rollout_image(path: Path) -> None:
    for job in (d for d in docs(path) if d["kind"] == "GRPOJob"):
        rollout = GRPOJob.model_validate(job).spec.rollout
        assert rollout.engine == "vllm"
        assert rollout.image.rsplit("/", 1)[-1].startswith("rollout:"), "vLLM lives in the rollout image only"


def test_default_rollout_image_serves_the_default_engine() -> None:
    rollout = RolloutSpec()
    assert rollout.engine == "vllm" and rollout.image.rsplit("/", 1)[-1].startswith("rollout:")


def test_p5_example_is_the_documented_shape() -> None:
    job = next(d for p, d in JOBS if p.name == "p5-qwen3-30b-a3b.yaml")
    spec = job["spec"]
    assert spec["trainer"]["instanceType"] == spec["rollout"]["instanceType"] == "p5.48xlarge"
    assert (spec["trainer"]["replicas"], spec["trainer"]["processesPerPod"]) == (2, 8)
    assert spec["trainer"]["expertParallelSize"] == 16 and spec["rollout"]["replicas"] == 4
    assert spec["network"]["efa"] == "required"
    assert spec["checkpoint"]["path"].startswith("s3://")
    assert spec["model"]["path"].startswith("pvc://")
    assert "eks.amazonaws.com/role-arn" in spec["trainer"]["serviceAccountAnnotations"]
    out = render(GRPOJob.model_validate(job), name=job["metadata"]["name"], namespace="ml", uid="u")
    trainer_sa = next(
        c
        for c in out.children
        if c["kind"] == "ServiceAccount" and c["metadata"]["name"].endswith("-trainer")
    )
    assert trainer_sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    assert out.contract.trainer.world_size == 16 and out.contract.trainer.backend == "nccl"


def test_pvc_paths_name_the_fsx_claim() -> None:
    claims = {d["metadata"]["name"] for d in of_kind("PersistentVolumeClaim")}
    volumes = {d["metadata"]["name"]: d for d in of_kind("PersistentVolume")}
    for claim in of_kind("PersistentVolumeClaim"):
        assert claim["spec"]["volumeName"] in volumes
        assert "ReadWriteMany" in claim["spec"]["accessModes"], "every rank and rollout server mounts it"
    for path, job in GPU_JOBS:
        spec = job["spec"]
        for uri in (
            spec["model"]["path"],
            spec["dataset"]["path"],
            spec.get("checkpoint", {}).get("path", ""),
        ):
            parsed = storage.parse_pvc(uri)
            if parsed:
                assert parsed[0] in claims, f"{path}: {uri} names no claim in examples/eks"


def _gpu_tolerations() -> list[list[dict[str, Any]]]:
    return [pod.get("tolerations", []) for _, job in GPU_JOBS for pod in rendered_pods(job).values()]


def test_eksctl_gpu_node_groups_fit_the_renderer() -> None:
    (cluster,) = of_kind("ClusterConfig")
    gpu_groups = [g for g in cluster["managedNodeGroups"] if g.get("efaEnabled") or g.get("taints")]
    assert {g["instanceType"] for g in gpu_groups} >= {"p5.48xlarge", "p5en.48xlarge"}
    addons = {a["name"] for a in cluster["addons"]}
    assert {"eks-pod-identity-agent", "aws-fsx-csi-driver"} <= addons and cluster["iam"]["withOIDC"]
    for group in gpu_groups:
        assert TABLE.get(group["instanceType"]).efa > 0 and group["efaEnabled"] is True
        assert len(group["availabilityZones"]) == 1, "EFA traffic stays in one AZ"
        assert group["availabilityZones"][0] in cluster["availabilityZones"]
        for taint in group["taints"]:
            assert all(tolerates(t, taint) for t in _gpu_tolerations()), f"{group['name']}: {taint}"


def test_karpenter_node_pools_fit_the_renderer() -> None:
    classes = {d["metadata"]["name"] for d in of_kind("EC2NodeClass")}
    pools = of_kind("NodePool")
    assert len(pools) == 2
    for pool in pools:
        tpl = pool["spec"]["template"]["spec"]
        assert tpl["nodeClassRef"]["name"] in classes
        req = {r["key"]: r for r in tpl["requirements"]}
        assert all(TABLE.get(t).efa > 0 for t in req[INSTANCE_TYPE_LABEL]["values"])
        assert len(req["topology.kubernetes.io/zone"]["values"]) == 1
        for taint in tpl["taints"]:
            assert all(tolerates(t, taint) for t in _gpu_tolerations()), (
                f"{pool['metadata']['name']}: {taint}"
            )
    capacity = {
        p["metadata"]["name"]: set(p["spec"]["template"]["spec"]["requirements"][1]["values"]) for p in pools
    }
    assert "spot" not in capacity["gpu-efa-training"], "trainer gangs stay off Spot"


def test_kueue_submission_is_consistent() -> None:
    (flavor,) = of_kind("ResourceFlavor")
    (cq,) = of_kind("ClusterQueue")
    (lq,) = of_kind("LocalQueue")
    (path, job), *_ = [
        (p, d) for p, d in JOBS if "kueue.x-k8s.io/queue-name" in d["metadata"].get("labels", {})
    ]
    (priority,) = of_kind("WorkloadPriorityClass")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == priority["metadata"]["name"]
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert job["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == lq["metadata"]["name"]
    assert job["metadata"]["namespace"] == lq["metadata"]["namespace"]
    assert not job["spec"].get("runPolicy", {}).get("suspend"), "a suspended job gives its Workload back"
    assert flavor["spec"]["nodeLabels"][INSTANCE_TYPE_LABEL] == job["spec"]["trainer"]["instanceType"]
    group = cq["spec"]["resourceGroups"][0]
    assert [f["name"] for f in group["flavors"]] == [flavor["metadata"]["name"]]
    requested = set()
    for pod in rendered_pods(job).values():
        requested |= set(pod["containers"][0]["resources"].get("requests", {}))
    assert requested <= set(group["coveredResources"]), (
        f"{path}: Kueue must account for every requested resource"
    )


def test_argocd_applications_point_at_real_paths() -> None:
    for path in sorted((ROOT / "deploy" / "argocd").glob("*application.yaml")):
        app = yaml.safe_load(path.read_text())
        source = app["spec"]["source"]
        folder = ROOT / source["path"]
        assert folder.is_dir(), f"{path}: {source['path']}"
        include = source.get("directory", {}).get("include")
        if include:
            patterns = include.strip("{}").split(",")
            for pattern in patterns:
                assert [f for f in folder.iterdir() if fnmatch.fnmatch(f.name, pattern)], pattern
        assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]
