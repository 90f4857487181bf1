"""The e2e cluster itself: the simulated EKS GPU fleet schedules and runs pods the way the
operator's trainer and rollout StatefulSets need, and the fail_pod helper drives failures.

These checks guard the ground every other e2e test stands on; they hold on the local kwok
cluster (hack/cluster.sh) and on a kind cluster prepared by hack/kind.sh alike, so they
select nodes by label, never by name.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

GPU = "nvidia.com/gpu"
EFA = "vpc.amazonaws.com/efa"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
# pause runs anywhere: kwok never pulls it and kind node images ship it.
IMAGE = "registry.k8s.io/pause:3.10"


def _nodes_of(api: client.ApiClient, instance_type: str) -> list[client.V1Node]:
    return client.CoreV1Api(api).list_node(label_selector=f"{INSTANCE_TYPE}={instance_type}").items


def _whole_node_pod_spec(efa: int) -> dict[str, Any]:
    """A trainer-shaped pod: all GPUs and EFA devices of a node. Small cpu and memory and no
    hugepages, because on kind those stay the Docker host's real ones."""
    limits = {GPU: "8", EFA: str(efa), "memory": "1Gi", "cpu": "1"}
    return {
        "tolerations": [GPU_TOLERATION],
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "trainer", "image": IMAGE, "resources": {"limits": limits}}],
    }


def _is_ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _ready_pod(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    pod = core.read_namespaced_pod(name, namespace)
    return pod if _is_ready(pod) else None


def test_fleet_offers_gpu_efa_capacity_with_eks_labels(k8s_api: client.ApiClient) -> None:
    expected_efa = {"p5.48xlarge": "32", "p5en.48xlarge": "16"}
    for instance_type, efa in expected_efa.items():
        nodes = _nodes_of(k8s_api, instance_type)
        assert nodes, f"no node labelled {INSTANCE_TYPE}={instance_type}"
        for node in nodes:
            name, alloc, labels = node.metadata.name, node.status.allocatable, node.metadata.labels
            assert alloc[GPU] == "8" and alloc[EFA] == efa, f"{name}: allocatable {alloc}"
            assert "hugepages-2Mi" in alloc, f"{name}: no hugepages-2Mi in {alloc}"
            for layer in (1, 2, 3):
                assert labels.get(f"topology.k8s.aws/network-node-layer-{layer}"), f"{name}: layer {layer}"
            assert labels.get("topology.kubernetes.io/zone"), f"{name}: no zone label"
            taints = {(t.key, t.effect) for t in node.spec.taints or []}
            assert (GPU, "NoSchedule") in taints, f"{name}: taints {taints}"
            assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
    cpu_taints = {
        n.metadata.name: [t.key for t in n.spec.taints or []]
        for n in client.CoreV1Api(k8s_api).list_node().items
        if GPU not in (n.status.allocatable or {})
    }
    assert any(not keys for keys in cpu_taints.values()), f"no untainted CPU node: {cpu_taints}"


def test_whole_node_gpu_pod_lands_on_p5_and_becomes_ready(
    k8s_api: client.ApiClient, namespace: str, wait_for: Callable[..., Any]
) -> None:
    core = client.CoreV1Api(k8s_api)
    pod = {"metadata": {"name": "trainer"}, "spec": _whole_node_pod_spec(efa=32)}
    core.create_namespaced_pod(namespace, pod)
    ready = wait_for(lambda: _ready_pod(core, namespace, "trainer"), what="pod trainer Ready")
    node = core.read_node(ready.spec.node_name)
    # Only p5.48xlarge offers 32 EFA devices; p5en has 16.
    assert node.metadata.labels[INSTANCE_TYPE] == "p5.48xlarge"
    assert ready.status.phase == "Running" and ready.status.pod_ip


def test_gpu_pod_without_toleration_stays_pending(
    k8s_api: client.ApiClient, namespace: str, wait_for: Callable[..., Any]
) -> None:
    core = client.CoreV1Api(k8s_api)
    spec = _whole_node_pod_spec(efa=16)
    spec["tolerations"] = []
    core.create_namespaced_pod(namespace, {"metadata": {"name": "untolerated"}, "spec": spec})

    def unschedulable() -> str | None:
        pod = core.read_namespaced_pod("untolerated", namespace)
        cond = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
        return cond.message if cond and cond.reason == "Unschedulable" else None

    message = wait_for(unschedulable, what="scheduler to report pod untolerated Unschedulable")
    assert "untolerated taint" in message and GPU in message, message


def test_statefulset_gang_gets_pods_on_distinct_nodes_and_replaces_a_failed_one(
    k8s_api: client.ApiClient,
    namespace: str,
    wait_for: Callable[..., Any],
    fail_pod: Callable[..., None],
) -> None:
    core, apps = client.CoreV1Api(k8s_api), client.AppsV1Api(k8s_api)
    labels = {"app": "gang"}
    service = {"metadata": {"name": "gang"}, "spec": {"clusterIP": "None", "selector": labels}}
    core.create_namespaced_service(namespace, service)
    sts = {
        "metadata": {"name": "gang"},
        "spec": {
            "replicas": 2,
            "serviceName": "gang",
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": _whole_node_pod_spec(efa=32)},
        },
    }
    apps.create_namespaced_stateful_set(namespace, sts)
    wait_for(
        lambda: apps.read_namespaced_stateful_set("gang", namespace).status.ready_replicas == 2,
        what="StatefulSet gang with 2 ready replicas",
    )
    pods = {p.metadata.name: p for p in core.list_namespaced_pod(namespace).items}
    assert sorted(pods) == ["gang-0", "gang-1"]
    assert pods["gang-0"].spec.node_name != pods["gang-1"].spec.node_name

    old_uid = pods["gang-0"].metadata.uid
    fail_pod(namespace, "gang-0", exit_code=137, reason="OOMKilled")

    def replaced_and_ready() -> bool:
        pod = core.read_namespaced_pod("gang-0", namespace)
        return pod.metadata.uid != old_uid and _is_ready(pod)

    wait_for(replaced_and_ready, what="StatefulSet to replace failed gang-0", ignore=(client.ApiException,))


def test_fail_pod_marks_a_running_pod_failed_with_exit_code(
    k8s_api: client.ApiClient,
    namespace: str,
    wait_for: Callable[..., Any],
    fail_pod: Callable[..., None],
) -> None:
    core = client.CoreV1Api(k8s_api)
    spec = {"containers": [{"name": "main", "image": IMAGE}], "terminationGracePeriodSeconds": 0}
    core.create_namespaced_pod(namespace, {"metadata": {"name": "victim"}, "spec": spec})
    victim = wait_for(lambda: _ready_pod(core, namespace, "victim"), what="pod victim Ready")
    # Without the GPU toleration only CPU nodes are open to it.
    assert GPU not in core.read_node(victim.spec.node_name).status.allocatable

    fail_pod(namespace, "victim", exit_code=3, message="rank 0 lost its peer")

    pod = core.read_namespaced_pod("victim", namespace)
    assert pod.status.phase == "Failed"
    terminated = pod.status.container_statuses[0].state.terminated
    assert terminated.exit_code == 3 and terminated.reason == "Error"
    assert terminated.message == "rank 0 lost its peer"
    assert not _is_ready(pod)


def test_tool_fixtures_reach_the_cluster_and_report_failures(
    kubectl: Callable[..., subprocess.CompletedProcess[str]],
    bin_dir: Path,
    namespace: str,
    wait_for: Callable[..., Any],
) -> None:
    version = json.loads(kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    # conftest.KubectlError, a RuntimeError carrying kubectl's stderr.
    with pytest.raises(RuntimeError, match=r"pods \"missing\" not found") as raised:
        kubectl("get", "pod", "missing", "-n", namespace)
    assert type(raised.value).__name__ == "KubectlError"
    assert kubectl("get", "pod", "missing", "-n", namespace, check=False).returncode != 0
    helm = subprocess.run(
        [bin_dir / "helm", "version", "--short"], capture_output=True, text=True, check=True
    )
    assert helm.stdout.startswith("v4.")
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_for(lambda: False, what="the impossible", timeout=0.2, interval=0.05)
