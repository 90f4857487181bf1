"""Fixtures of the e2e ring: a real Kubernetes API server with kwok-simulated EKS GPU nodes.

Every test under tests/e2e is marked ``e2e`` automatically. The cluster is the one
``KUBECONFIG`` points at when it is set (a kind cluster made by ``hack/kind.sh``, or any
other); otherwise, or when it names the local cluster's kubeconfig, ``hack/cluster.sh up``
starts (or reuses) the local control plane and leaves it running for the next session,
unless ``GRPO_E2E_DOWN=1`` asks for ``hack/cluster.sh down`` at the end. On a cold cache that
builds the binaries first (minutes): in CI run ``hack/cluster.sh up`` before pytest.

Fixtures for other test modules:

- ``kubeconfig`` (session): path of the kubeconfig file.
- ``bin_dir`` (session): directory of the cached binaries (kubectl, helm, kwokctl, ...).
- ``kubectl`` (session): ``kubectl(*args, input=None, check=True, timeout=120)`` runs the
  cached kubectl against the cluster and returns the ``CompletedProcess`` (text); with
  ``check=True`` a non-zero exit raises ``KubectlError`` carrying the command and stderr.
- ``k8s_api`` (session): a ``kubernetes.client.ApiClient`` for that cluster.
- ``namespace`` (function): a fresh namespace (labelled ``grpo.dev/e2e=true``) whose default
  ServiceAccount exists, deleted after the test without waiting.
- ``wait_for`` (session): ``wait_for(predicate, what=..., timeout=60, interval=0.5,
  ignore=())`` polls until ``predicate()`` is truthy and returns that value; on timeout it
  raises ``TimeoutError`` naming ``what`` and the last value or ignored exception.
- ``third_party_crds`` (session): the CRDs of Kueue, Karpenter and prometheus-operator kinds
  (fetched by ``hack/third-party-crds.sh`` from their Go modules) installed and Established,
  so examples and chart objects of those kinds get a server-side dry-run too.
- ``fail_pod`` (session): ``fail_pod(namespace, name, exit_code=1, reason="Error",
  message="")`` makes a pod look as if its containers exited: phase ``Failed``, every
  container terminated with ``exit_code``, Ready/ContainersReady ``False``. It patches the
  pod's status subresource (what a kubelet does); kwok's default stages never move a pod
  out of ``Failed``, so the state sticks until a controller deletes the pod.
- ``lws_controller`` (session): the real LeaderWorkerSet controller (``hack/lws.sh build`` and
  ``up``: its CRD, its manager as a process beside the local cluster, its webhooks registered);
  returns the manager's log path. On a cluster other than the local one it installs nothing and
  returns ``None`` when that cluster serves the LWS CRD, and skips the test when it does not.
  ``GRPO_E2E_DOWN=1`` stops the manager at the end.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
import yaml
from kubernetes import client, config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CLUSTER_SH = ROOT / "hack" / "cluster.sh"
BUILD_SH = ROOT / "hack" / "build-control-plane.sh"
CRDS_SH = ROOT / "hack" / "third-party-crds.sh"
LWS_SH = ROOT / "hack" / "lws.sh"
T = TypeVar("T")


class KubectlError(RuntimeError):
    """A kubectl call exited non-zero; the message carries the command and its stderr."""


class Kubectl(Protocol):
    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]: ...


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark this directory's tests e2e so `-m "not e2e"` deselects them without a decorator each."""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


def _run_script(*args: str, timeout: float) -> str:
    proc = subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = proc.stderr[-4000:]
        raise RuntimeError(f"{' '.join(args)} failed with exit code {proc.returncode}:\n{tail}")
    return proc.stdout


@pytest.fixture(scope="session")
def bin_dir() -> Path:
    return Path(_run_script(str(BUILD_SH), "print-bin-dir", timeout=30).strip())


@pytest.fixture(scope="session")
def kubeconfig() -> Iterator[Path]:
    """The cluster under test; starts the local one only when KUBECONFIG names none."""
    configured = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    local = Path(_run_script(str(CLUSTER_SH), "kubeconfig", timeout=30).strip())
    # A KUBECONFIG exported from an earlier `hack/cluster.sh up` still means the local cluster,
    # which `up` revives (in seconds) if it was stopped since.
    if configured and Path(configured).expanduser().resolve() != local.resolve():
        path = Path(configured).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"KUBECONFIG={configured} does not exist")
        yield path
        return
    # A cold cache builds Kubernetes from source first (about 6 min here); a warm one takes seconds.
    out = _run_script(str(CLUSTER_SH), "up", timeout=3600)
    match = re.search(r"^export KUBECONFIG=(.+)$", out, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"hack/cluster.sh up printed no 'export KUBECONFIG=' line:\n{out}")
    yield Path(match.group(1))
    if os.environ.get("GRPO_E2E_DOWN") == "1":
        _run_script(str(CLUSTER_SH), "down", timeout=120)


@pytest.fixture(scope="session")
def kubectl(bin_dir: Path, kubeconfig: Path) -> Kubectl:
    binary = bin_dir / "kubectl"
    exe = str(binary) if binary.exists() else shutil.which("kubectl")
    if exe is None:
        raise FileNotFoundError(f"no kubectl in {bin_dir} or on PATH; run hack/build-control-plane.sh")

    def run(
        *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        cmd = [exe, "--kubeconfig", str(kubeconfig), *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    return run


@pytest.fixture(scope="session")
def k8s_api(kubeconfig: Path) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(kubeconfig))
    yield api
    api.close()


def _wait_for(
    predicate: Callable[[], T],
    *,
    what: str,
    timeout: float = 60,
    interval: float = 0.5,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll instead of sleeping a fixed time: controllers here react in milliseconds to seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
            if last:
                return last
        except ignore as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def _established(kubectl: Kubectl, names: Iterable[str], timeout: float = 60) -> None:
    """Poll each CRD's Established condition. `kubectl wait` errors out instead of waiting when a
    just-applied CRD has no conditions yet, so it cannot be used right after an apply."""
    jsonpath = "jsonpath={.status.conditions[?(@.type=='Established')].status}"
    for name in names:
        _wait_for(
            lambda name=name: kubectl("get", f"crd/{name}", "-o", jsonpath, check=False).stdout == "True",
            what=f"CRD {name} to be Established",
            timeout=timeout,
        )


@pytest.fixture(scope="session")
def established(kubectl: Kubectl) -> Callable[..., None]:
    """`established(*names)` returns once every named CRD serves its kind."""
    return lambda *names: _established(kubectl, names)


@pytest.fixture(scope="session")
def third_party_crds(kubectl: Kubectl) -> Path:
    crd_dir = Path(_run_script(str(CRDS_SH), timeout=600).strip())
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_dir))
    names = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in sorted(crd_dir.glob("*.yaml"))]
    _established(kubectl, names)
    return crd_dir


@pytest.fixture(scope="session")
def lws_controller(kubeconfig: Path, kubectl: Kubectl) -> Iterator[Path | None]:
    local = Path(_run_script(str(CLUSTER_SH), "kubeconfig", timeout=30).strip())
    if kubeconfig.resolve() != local.resolve():
        # hack/lws.sh serves the webhooks on this machine's loopback, which only the local API server reaches.
        crd = "crd/leaderworkersets.leaderworkerset.x-k8s.io"
        if kubectl("get", crd, check=False).returncode != 0:
            pytest.skip(f"{kubeconfig} is not the local cluster and serves no LeaderWorkerSet CRD")
        yield None
        return
    _run_script(str(LWS_SH), "build", timeout=1800)
    yield Path(_run_script(str(LWS_SH), "up", timeout=300).strip())
    if os.environ.get("GRPO_E2E_DOWN") == "1":
        _run_script(str(LWS_SH), "down", timeout=120)


@pytest.fixture(scope="session")
def wait_for() -> Callable[..., Any]:
    return _wait_for


@pytest.fixture
def namespace(request: pytest.FixtureRequest, k8s_api: client.ApiClient) -> Iterator[str]:
    """A namespace per test keeps tests independent on a cluster shared between sessions."""
    core = client.CoreV1Api(k8s_api)
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"e2e-{slug}-{uuid.uuid4().hex[:6]}"
    body = client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels={"grpo.dev/e2e": "true"}))
    core.create_namespace(body)
    # Pods are rejected until the controller-manager has created the default ServiceAccount.
    _wait_for(
        lambda: core.read_namespaced_service_account("default", name),
        what=f"ServiceAccount default in namespace {name}",
        timeout=30,
        ignore=(client.ApiException,),
    )
    yield name
    core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture(scope="session")
def fail_pod(k8s_api: client.ApiClient) -> Callable[..., None]:
    core = client.CoreV1Api(k8s_api)

    def fail(namespace: str, name: str, exit_code: int = 1, reason: str = "Error", message: str = "") -> None:
        pod = core.read_namespaced_pod(name, namespace)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        terminated = {"exitCode": exit_code, "reason": reason, "message": message}
        terminated |= {"startedAt": now, "finishedAt": now}
        state = {"ready": False, "restartCount": 0, "state": {"terminated": terminated}}
        statuses = [{"name": c.name, "image": c.image, **state} for c in pod.spec.containers]
        conditions = [
            {"type": t, "status": "False", "reason": "PodFailed", "lastTransitionTime": now}
            for t in ("Ready", "ContainersReady")
        ]
        body = {"status": {"phase": "Failed", "containerStatuses": statuses, "conditions": conditions}}
        core.patch_namespaced_pod_status(
            name, namespace, body, _content_type="application/strategic-merge-patch+json"
        )

    return fail
