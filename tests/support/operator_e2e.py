"""The operator as a real process against the e2e cluster, and readers of what it made: for the
operator's e2e tests (tests/e2e/test_operator.py, test_child_ownership.py, test_reward_role.py).

`crd` (module), `operator`, `kueue_operator` and `cluster` are fixtures, shared by name with the
modules that bind them. The CRD applied is crds/grpojobs.grpo.dev.yaml, or the file GRPO_E2E_CRD names.
"""

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from grpo_operator.api.job import GROUP, PLURAL, VERSION
from kubernetes import client

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


CRD = Path(os.environ.get("GRPO_E2E_CRD", ROOT / "crds" / "grpojobs.grpo.dev.yaml"))


CHILD_KINDS = (
    "configmap,serviceaccount,role,rolebinding,service,statefulset,poddisruptionbudget,networkpolicy,secret"
)


class Operator:
    """The operator as a subprocess; logs go to a file printed when a test fails."""

    def __init__(self, kubeconfig: Path, namespace: str, log: Path, *extra: str) -> None:
        self.kubeconfig, self.namespace, self.log, self.extra = kubeconfig, namespace, log, extra
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Operator":
        cmd = [sys.executable, "-m", "grpo_operator.cli", "operator", "--namespace", self.namespace]
        cmd += ["--metrics-port", str(self.port), "--metrics-host", "127.0.0.1", "--resync-seconds", "2"]
        cmd += ["--verify-seconds", "4", *self.extra]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str) -> float:
        """Sum of the samples of one series of the operator's /metrics (all label sets)."""
        _, text = self.get("/metrics")
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((f"{name} ", f"{name}{{"))
        )

    def writes(self) -> float:
        """Total API writes the operator sent (its own counter)."""
        return self.metric("grpo_operator_api_writes_total")


@pytest.fixture(scope="module")
def crd(kubectl, established):
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    established("grpojobs.grpo.dev")


@pytest.fixture
def operator(crd, kubeconfig, kubectl, namespace, tmp_path):
    op = Operator(kubeconfig, namespace, tmp_path / "operator.log").start()
    yield op
    op.kill(signal.SIGTERM)  # jobs carry no finalizer: the namespace goes without the operator
    print(op.log.read_text()[-8000:])  # pytest shows it only when the test failed


@pytest.fixture
def kueue_operator(crd, third_party_crds, kubeconfig, kubectl, namespace, tmp_path):
    """The operator with --kueue; this cluster has Kueue's CRDs but no Kueue controller, so the
    tests write what Kueue's scheduler would (admission, eviction), as kwok plays the kubelet."""
    op = Operator(kubeconfig, namespace, tmp_path / "operator.log", "--kueue").start()
    yield op
    kubectl("delete", "grpojobs", "--all", "-n", namespace, "--timeout=60s", check=False)
    op.kill(signal.SIGTERM)
    print(op.log.read_text()[-8000:])


def manifest(name: str, *, trainer: dict | None = None, rollout: dict | None = None, **spec) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GRPOJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "s3://models/qwen3-30b-a3b"},
            "dataset": {"path": "s3://datasets/gsm8k.jsonl"},
            "reward": {"functions": [{"builtin": "math"}]},
            "checkpoint": {"path": "s3://checkpoints/e2e"},  # shared storage: the gang has two pods
            "trainer": trainer or {"replicas": 2, "instanceType": "p5.48xlarge", "processesPerPod": 8},
            "rollout": rollout or {"replicas": 2, "engine": "torch"},
            **spec,
        },
    }


class Cluster:
    """Small readers over the real API for the assertions below."""

    def __init__(self, api: client.ApiClient, kubectl, namespace: str, wait_for) -> None:
        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.kubectl, self.ns, self.wait_for = kubectl, namespace, wait_for

    def create(self, body: dict) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def job(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def gone(self, name: str) -> bool:
        """True once the API server answers 404 for the job (finalizers lifted, object removed)."""
        try:
            self.job(name)
            return False
        except client.ApiException as e:
            return e.status == 404

    def patch(self, name: str, spec: dict) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    def status(self, name: str) -> dict:
        return self.job(name).get("status") or {}

    def pods(self, name: str, role: str) -> list:
        sel = f"grpo.dev/job={name},grpo.dev/role={role}"
        return [
            p
            for p in self.core.list_namespaced_pod(self.ns, label_selector=sel).items
            if not p.metadata.deletion_timestamp
        ]

    def uids(self, name: str, role: str) -> dict[str, str]:
        return {p.metadata.name: p.metadata.uid for p in self.pods(name, role)}

    def ready(self, name: str, role: str, n: int) -> list:
        pods = self.pods(name, role)
        ok = len(pods) == n and all(
            any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or [])) for p in pods
        )
        return pods if ok else []

    def wait_phase(self, name: str, phase: str, timeout: float = 90) -> dict:
        try:
            return self.wait_for(
                lambda: (s := self.status(name)).get("phase") == phase and s, what="", timeout=timeout
            )
        except TimeoutError:
            pods = self.core.list_namespaced_pod(self.ns).items
            seen = [(p.metadata.name, p.status.phase, p.spec.node_name, p.metadata.labels) for p in pods]
            raise TimeoutError(
                f"{name} not {phase} after {timeout}s: status {self.status(name)}; pods {seen}"
            ) from None

    def condition(self, name: str, ctype: str) -> dict:
        return next(c for c in self.status(name).get("conditions", []) if c["type"] == ctype)

    def has_condition(self, name: str, ctype: str) -> dict | None:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == ctype), None)

    def children(self) -> list[str]:
        out = self.kubectl(
            "get",
            CHILD_KINDS,
            "-n",
            self.ns,
            "-l",
            "app.kubernetes.io/managed-by=grpo-operator",
            "-o",
            "name",
        )
        return sorted(out.stdout.split())


@pytest.fixture
def cluster(k8s_api, kubectl, namespace, wait_for) -> Cluster:
    return Cluster(k8s_api, kubectl, namespace, wait_for)
