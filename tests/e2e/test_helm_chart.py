"""The chart and the examples against the real API server: server-side dry-run and install.

`helm template` output (CRDs included) and every example's Kubernetes objects go through
`kubectl apply --server-side --dry-run=server`, so admission, schema and CEL rules judge
them; then `helm install` puts the chart into the local cluster and every object it made is
read back. The Kueue, Karpenter and prometheus-operator kinds are judged against those
projects' own CRDs (the `third_party_crds` fixture); eksctl's ClusterConfig, which is no
Kubernetes object at all, is the one kind named and left out.
"""

import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "grpo-operator"
EXAMPLES = ROOT / "examples"
# eksctl's config file is read by eksctl, never by an API server.
ABSENT_GROUPS = {"eksctl.io"}
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "ClusterKopfPeering",
    "PersistentVolume",
    "PriorityClass",
    "ResourceFlavor",
    "ClusterQueue",
    "WorkloadPriorityClass",
    "NodePool",
    "EC2NodeClass",
}


def helm(bin_dir: Path, kubeconfig: Path, *args: str, timeout: float = 180) -> str:
    proc = subprocess.run(
        [str(bin_dir / "helm"), "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def group_of(doc: dict[str, Any]) -> str:
    return doc["apiVersion"].rpartition("/")[0]


def install_crds(
    kubectl: Callable[..., subprocess.CompletedProcess[str]], established: Callable[..., None]
) -> None:
    """The chart's CRDs for real, so their kinds can be dry-run, applied server-side as `helm
    install` does (forcing: a cluster kept from an older checkout may hold an older CRD)."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    established("grpojobs.grpo.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev")


def dry_run(kubectl: Callable[..., subprocess.CompletedProcess[str]], docs: list[dict[str, Any]]) -> str:
    text = yaml.safe_dump_all(docs)
    proc = kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=text, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("watch.scope=namespaces",),
        (
            "metrics.serviceMonitor.enabled=true",
            "metrics.prometheusRule.enabled=true",
            "metrics.podMonitor.enabled=true",
            "kueue.enabled=true",
            "instanceTypes.p6e-gb200\\.36xlarge.gpus=4",
            "instanceTypes.p6e-gb200\\.36xlarge.efa=8",
        ),
    ],
    ids=["cluster", "namespaced", "monitoring-kueue-and-instance-types"],
)
def test_helm_template_is_accepted_by_the_api_server(
    sets: tuple[str, ...],
    namespace: str,
    bin_dir: Path,
    kubeconfig: Path,
    kubectl,
    established,
    third_party_crds: Path,
) -> None:
    install_crds(kubectl, established)
    args = ["template", f"r{uuid.uuid4().hex[:6]}", str(CHART), "--namespace", namespace, "--include-crds"]
    for s in sets:
        args += ["--set", s]
    if "watch.scope=namespaces" in sets:
        args += ["--set", f"watch.namespaces={{{namespace}}}"]
    docs = [d for d in yaml.safe_load_all(helm(bin_dir, kubeconfig, *args)) if d]
    absent = [d for d in docs if group_of(d) in ABSENT_GROUPS]
    present = [d for d in docs if group_of(d) not in ABSENT_GROUPS]
    out = dry_run(kubectl, present)
    for doc in present:
        assert f"{doc['kind'].lower()}" in out.lower() and doc["metadata"]["name"] in out
    assert not absent
    monitors = sorted(d["kind"] for d in present if group_of(d) == "monitoring.coreos.com")
    assert monitors == (
        ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
        if "metrics.prometheusRule.enabled=true" in sets
        else []
    )


def example_objects(namespace: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every example object the cluster can judge (namespaced ones moved to `namespace`), and
    the names of those it cannot."""
    present, absent = [], []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        if any(part.startswith(".") for part in path.relative_to(EXAMPLES).parts):
            continue
        for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
            if group_of(doc) in ABSENT_GROUPS:
                absent.append(f"{path.name}:{doc['kind']}")
                continue
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
            present.append(doc)
    return present, absent


def test_examples_pass_server_side_dry_run(
    namespace: str, kubectl, established, third_party_crds: Path
) -> None:
    install_crds(kubectl, established)
    present, absent = example_objects(namespace)
    kinds = {d["kind"] for d in present}
    assert {"GRPOJob", "PersistentVolume", "PersistentVolumeClaim"} <= kinds
    assert {"ResourceFlavor", "ClusterQueue", "LocalQueue", "NodePool", "EC2NodeClass"} <= kinds
    assert len([d for d in present if d["kind"] == "GRPOJob"]) >= 5
    out = dry_run(kubectl, present)
    assert out.count("(server dry run)") == len(present)
    assert absent == ["eksctl-cluster.yaml:ClusterConfig"]


def test_helm_install_creates_every_object(namespace: str, bin_dir: Path, kubeconfig: Path, kubectl) -> None:
    """Installed into a namespace that enforces the `restricted` Pod Security Standard, so the
    API server itself judges the operator pod's hardening; kwok then runs its replicas."""
    kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    release = f"g{uuid.uuid4().hex[:8]}"
    sets = ["--set", "watch.scope=namespaces", "--set", f"watch.namespaces={{{namespace}}}"]
    helm(bin_dir, kubeconfig, "install", release, str(CHART), "--namespace", namespace, *sets)
    try:
        manifest = helm(bin_dir, kubeconfig, "get", "manifest", release, "--namespace", namespace)
        docs = [d for d in yaml.safe_load_all(manifest) if d]
        expected = {"Deployment", "ServiceAccount", "Role", "RoleBinding", "KopfPeering"}
        assert {d["kind"] for d in docs} >= expected
        for doc in docs:
            ns = [] if doc["kind"] in CLUSTER_SCOPED else ["-n", doc["metadata"].get("namespace", namespace)]
            resource = doc["kind"].lower() + (f".{group_of(doc)}" if group_of(doc) else "")
            kubectl("get", resource, doc["metadata"]["name"], *ns)
        crds = kubectl("get", "crd", "-o", "name").stdout
        for crd in ("grpojobs.grpo.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
            assert crd in crds
        deployment = next(d for d in docs if d["kind"] == "Deployment")["metadata"]["name"]
        rollout = ["rollout", "status", f"deployment/{deployment}", "-n", namespace, "--timeout=120s"]
        kubectl(*rollout, timeout=150)
    finally:
        helm(bin_dir, kubeconfig, "uninstall", release, "--namespace", namespace)
