"""The harness's kwok deletes only the pod whose deletion it saw (hack/kwok-pod-delete.yaml).

kwok's default pod-delete Stage deletes by name on every event of a terminating pod, including the
one the API server writes while it removes a grace-0 pod, so a stale delete could remove a
same-named replacement (a gang restart's new trainer-0). Measured against kwok's real behaviour,
not read from the Stage: kwok controllers run by this test, once with kwok's default Stages and
once with the harness's, against an API server of their own (etcd + kube-apiserver; the shared
cluster's kwok manages every node, so a second one there would fight it). Each check must fail
with kwok's defaults and pass with the harness's, so it cannot pass by doing nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "hack" / "cluster.sh"
NODE = "kwok-check"


@pytest.fixture(scope="module")
def bare_api(bin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An etcd and a kube-apiserver of this module's own (kwokctl's binary runtime), no controllers:
    only the kwok controllers the tests start act on its pods. Yields its kubeconfig."""
    workdir = tmp_path_factory.mktemp("kwok-check")
    env = {**os.environ, "KWOK_WORKDIR": str(workdir), "KWOK_KUBECTL_BINARY": str(bin_dir / "kubectl")}
    kwokctl = [str(bin_dir / "kwokctl"), "--name", "stages", "-v", "WARN"]
    create = [
        *kwokctl, "create", "cluster", "--runtime", "binary", "--kubeconfig", "",
        "--config", str(ROOT / "hack" / "kwokctl.yaml"),
        "--disable", "kube-controller-manager,kube-scheduler,kwok-controller",
        "--kube-admission=false",  # no controller-manager makes no default ServiceAccount
        "--etcd-binary", str(bin_dir / "etcd"), "--kube-apiserver-binary", str(bin_dir / "kube-apiserver"),
        "--wait", "120s",
    ]  # fmt: skip
    proc = subprocess.run(create, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        yield workdir / "clusters" / "stages" / "kubeconfig.yaml"
    finally:
        delete = [*kwokctl, "delete", "cluster"]
        subprocess.run(delete, env=env, capture_output=True, timeout=120, check=False)


def stage_set(which: str) -> Path:
    cmd = ["bash", str(CLUSTER_SH), "stages", which]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


class Kwok:
    """A kwok controller process managing every node of the bare API server, logging at debug."""

    def __init__(self, bin_dir: Path, kubeconfig: Path, stages: Path, log: Path) -> None:
        self.log = log
        cmd = [
            str(bin_dir / "kwok"), f"--kubeconfig={kubeconfig}", f"--config={stages}",
            "--manage-all-nodes=true", f"--server-address=127.0.0.1:{free_port()}",
            "--node-name=localhost", "--v=DEBUG",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def deletes(self, pod: str) -> list[str]:
        """kwok's delete calls for `pod` (default/pod) that it logged: done or failed."""
        key = f"default/{pod}"
        return [
            line
            for line in self.log.read_text(errors="replace").splitlines()
            if key in line and ("Delete pod" in line or re.search(r"failed to delete pod", line))
        ]


@pytest.fixture(params=["kwok-default", "harness"])
def kwok(request, bin_dir: Path, bare_api: Path, tmp_path: Path, wait_for) -> Iterator[tuple[str, Kwok]]:
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(bare_api)))
    with contextlib.suppress(client.ApiException):
        core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    k = Kwok(bin_dir, bare_api, stage_set(request.param), tmp_path / "kwok.log")
    try:
        wait_for(lambda: ready(core.read_node(NODE)), what=f"kwok ({request.param}) to make its node Ready")
        yield request.param, k
    finally:
        k.stop()
        for pod in core.list_namespaced_pod("default").items:
            with contextlib.suppress(client.ApiException):
                core.delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0)


@pytest.fixture
def core(bare_api: Path) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(bare_api)))


def ready(obj) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in obj.status.conditions or [])


def pod(name: str, grace: int = 30) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": NODE,
            "terminationGracePeriodSeconds": grace,
            "containers": [{"name": "c", "image": "kwok.invalid/none"}],
        },
    }


def running(core: client.CoreV1Api, name: str) -> Callable[[], str | None]:
    """The pod's uid once kwok has made it Running."""

    def check() -> str | None:
        p = core.read_namespaced_pod(name, "default")
        return p.metadata.uid if p.status.phase == "Running" else None

    return check


def gone(core: client.CoreV1Api, name: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            core.read_namespaced_pod(name, "default")
        except client.ApiException as e:
            return e.status == 404
        return False

    return check


def uid(core: client.CoreV1Api, name: str) -> str | None:
    try:
        return core.read_namespaced_pod(name, "default").metadata.uid
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


TRIES = 5  # the race below, played this many times per stage set


def test_a_stale_delete_never_reaches_a_same_named_replacement(kwok, core, wait_for):
    """The gang-restart fault: kwok is paused while a pod is deleted (grace 0, two writes in the API
    server) and a same-named replacement is created, then resumed, so the old pod's events reach it
    after the replacement exists. Whether kwok's default pod-delete then deletes the replacement by
    name is itself a race inside kwok (v0.8.0 pkg/kwok/controllers/pod_controller.go: the old pod's
    Deleted event, :526-540, and the replacement's first stage job, :862-864, cancel a queued delete
    by name, unless its worker already took it), so it is played TRIES times: kwok's default
    deletes a replacement at least once (once seen under load in one try of one, never in ten
    unloaded); the harness's Stages leave every replacement running."""
    which, k = kwok
    stale = 0
    for attempt in range(TRIES):
        name = f"trainer-{attempt}"
        core.create_namespaced_pod("default", pod(name))
        wait_for(running(core, name), what=f"{name} Running")
        k.pause()
        try:
            core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
            wait_for(gone(core, name), what=f"{name} removed", interval=0.05)
            replacement = core.create_namespaced_pod("default", pod(name)).metadata.uid
        finally:
            k.resume()
        if which == "kwok-default":
            try:
                wait_for(lambda: uid(core, name) != replacement, what="a stale delete", timeout=15)  # noqa: B023
                stale += 1
                break  # the fault is shown
            except TimeoutError:
                continue  # kwok cancelled its queued delete this time
        assert wait_for(running(core, name), what=f"the replacement {name} Running") == replacement
        # kwok handles a pod's events in order: once a pod created after the replacement runs, every
        # event of the old pod has been matched; a delete job it queued would have started by then.
        marker = f"marker-{attempt}"
        core.create_namespaced_pod("default", pod(marker))
        wait_for(running(core, marker), what="a later pod Running")
        assert uid(core, name) == replacement
    if which == "kwok-default":
        assert stale == 1, f"kwok's default Stages deleted no replacement in {TRIES} tries"
        return
    assert all(k.deletes(f"trainer-{attempt}") == [] for attempt in range(TRIES))


def test_a_graceful_deletion_costs_exactly_one_kwok_delete(kwok, core, wait_for):
    """What the mechanism does, counted (the shared cluster's e2e ring logged 143 deletes that found
    nothing with kwok's defaults): kwok's delete of a pod in graceful deletion is followed by the API
    server's grace-0 write, which kwok's default pod-delete answers with a second delete by name."""
    which, k = kwok
    names = [f"graceful-{i}" for i in range(5)]
    for name in names:
        core.create_namespaced_pod("default", pod(name))
    for name in names:
        wait_for(running(core, name), what=f"{name} Running")
        core.delete_namespaced_pod(name, "default")  # the pod's own grace period: 30 s
    for name in names:
        wait_for(gone(core, name), what=f"{name} removed by kwok")
    core.create_namespaced_pod("default", pod("marker"))
    wait_for(running(core, "marker"), what="a later pod Running")
    counts = {name: len(k.deletes(name)) for name in names}
    if which == "kwok-default":
        wait_for(
            lambda: all(len(k.deletes(n)) == 2 for n in names) or {n: k.deletes(n) for n in names},
            what="a second, stale delete per pod",
            timeout=30,
        )
        return
    assert counts == dict.fromkeys(names, 1), {n: k.deletes(n) for n in names}
