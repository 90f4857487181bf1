"""The chart's RBAC, proven by running the operator under the chart's own identity.

Pods do not run under kwok, so the operator runs here as a process, started with the
container args the chart renders, authenticated as the chart's ServiceAccount (a token from
the TokenRequest API in a kubeconfig of its own). Its API traffic passes through a small
recording reverse proxy, so the test knows every (verb, resource) it used and every answer.

It drives the p5 example job to Running, fails a trainer pod and waits for the gang restart,
then asserts: no request was refused (a missing permission fails here), and every rule the
chart grants was exercised (a permission the operator never uses fails here too), apart from
the few listed in NOT_EXERCISED with the reason this run cannot reach them. Both watch scopes
run. Two more tests: a permission taken from the chart's Role shows up as a recorded 403, and
two replicas (the chart's peering) elect one leader whose stop hands the job to the standby.
"""

import asyncio
import base64
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web
from grpo_operator.api.job import GROUP, PLURAL, VERSION
from kubernetes import client

from tests.support.kueue_status import KUEUE, condition
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "grpo-operator"
EXAMPLE = ROOT / "examples" / "p5-qwen3-30b-a3b.yaml"
LWS = ("leaderworkerset.x-k8s.io", "v1")
FSX = ROOT / "examples" / "eks" / "fsx-lustre.yaml"
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}
# (verb, group, resource) the chart grants that one lifecycle run cannot reach, and why.
NOT_EXERCISED = {
    ("delete", "grpo.dev", "grpojobs"): "ttlSecondsAfterFinished after Succeeded/Failed",
    ("get", "grpo.dev", "grpojobs/status"): "held only to grant it to each job's trainer Role",
    ("list", "discovery.k8s.io", "endpointslices"): "held only to grant it to each job's trainer Role",
}
# Refusals the operator expects and tolerates (controller/peering.py tries to create what the
# chart already installed); the chart deliberately withholds these rights.
TOLERATED_DENIALS = {
    ("create", "apiextensions.k8s.io", "customresourcedefinitions"),
    ("create", "kopf.dev", "clusterkopfpeerings"),
    ("create", "kopf.dev", "kopfpeerings"),
}


@dataclass(frozen=True)
class Call:
    verb: str
    group: str
    resource: str
    namespace: str
    status: int
    message: str = ""

    @property
    def denied(self) -> bool:
        """Refused by RBAC (not, say, a 403 for writing into a terminating namespace)."""
        return self.status == 401 or (self.status == 403 and "forbidden: User" in self.message)


def classify(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str, str] | None:
    """(verb, group, resource[/subresource], namespace) of a resource request, as RBAC sees it."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        group, rest = parts[1], parts[3:]
    else:
        return None  # discovery, /version, /openapi: non-resource URLs
    if not rest:
        return None
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else "", rest[2] if len(rest) > 2 else ""
    if sub:
        resource = f"{resource}/{sub}"
    watch = query.get("watch") in {"true", "1"}
    verb = {
        "GET": "watch" if watch else ("get" if name else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }[method]
    return verb, group, resource, namespace


@dataclass
class RecordingProxy:
    """Plain-HTTP reverse proxy on loopback to the API server; records every resource call."""

    upstream: str
    ca_file: str
    calls: list[Call] = field(default_factory=list)
    port: int = 0
    _handlers: set[asyncio.Task] = field(default_factory=set)

    def start(self) -> None:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._serve, args=(ready,), daemon=True, name="rbac-proxy").start()
        assert ready.wait(10), "proxy did not start"

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx), timeout=aiohttp.ClientTimeout(total=None)
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = await request.read()
        async with self._session.request(
            request.method,
            self.upstream + request.rel_url.raw_path_qs,
            headers=headers,
            data=body or None,
            auto_decompress=False,
            skip_auto_headers=("Content-Type",),  # the python client sends none; neither may we
        ) as upstream:
            kind = classify(request.method, request.path, dict(request.query))
            error = (await upstream.read()) if upstream.status >= 400 else None
            if kind is not None:
                message = error.decode(errors="replace") if error else ""
                self.calls.append(Call(*kind, status=upstream.status, message=message))
                if kind[0] == "patch" and upstream.status == 201:  # an apply that created the object
                    self.calls.append(Call("create", *kind[1:], status=upstream.status))
            response = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP_HEADERS:
                    response.headers[k] = v
            if upstream.headers.get("Content-Encoding"):
                response.headers["Content-Encoding"] = upstream.headers["Content-Encoding"]
            await response.prepare(request)
            if error is not None:
                await response.write(error)
                return response
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (ConnectionResetError, aiohttp.ClientError):
                pass  # the client closed a watch
            return response

    def stop(self) -> None:
        async def close() -> None:
            for task in list(self._handlers):  # watches stream until cancelled
                task.cancel()
            await self._runner.cleanup()
            await self._session.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)


def helm(bin_dir: Path, kubeconfig: Path, *args: str) -> str:
    proc = subprocess.run(
        [str(bin_dir / "helm"), "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def granted(docs: list[dict[str, Any]], namespace: str) -> set[tuple[str, str, str]]:
    """(verb, group, resource) the chart's Roles/ClusterRoles bound to its ServiceAccount grant for
    this run's namespace (the chart's ClusterRole for platform admins is bound to nobody)."""
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    bound = {
        (b["roleRef"]["kind"], b["roleRef"]["name"])
        for b in docs
        if b["kind"] in {"RoleBinding", "ClusterRoleBinding"}
        and any(
            s.get("kind") == "ServiceAccount" and s.get("name") in accounts for s in b.get("subjects") or []
        )
    }
    out = set()
    for role in docs:
        if role["kind"] == "Role" and role["metadata"]["namespace"] != namespace:
            continue
        if role["kind"] in {"Role", "ClusterRole"} and (role["kind"], role["metadata"]["name"]) in bound:
            for rule in role["rules"]:
                for verb in rule["verbs"]:
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            out.add((verb, group, resource))
    return out


def admin_server(kubeconfig: Path) -> tuple[str, str]:
    """(server URL, CA file) of the admin kubeconfig's current cluster."""
    cfg = yaml.safe_load(kubeconfig.read_text())
    context = next(c for c in cfg["contexts"] if c["name"] == cfg["current-context"])["context"]
    cluster = next(c for c in cfg["clusters"] if c["name"] == context["cluster"])["cluster"]
    ca = cluster.get("certificate-authority")
    if ca is None:
        ca_path = kubeconfig.parent / f"ca-{uuid.uuid4().hex[:6]}.crt"
        ca_path.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
        ca = str(ca_path)
    return cluster["server"], ca


def token_kubeconfig(path: Path, server: str, token: str, namespace: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "proxy", "cluster": {"server": server}}],
                "users": [{"name": "operator", "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "operator",
                        "context": {"cluster": "proxy", "user": "operator", "namespace": namespace},
                    }
                ],
                "current-context": "operator",
            }
        )
    )
    return path


@dataclass
class OperatorRun:
    proxy: RecordingProxy
    granted: set[tuple[str, str, str]]
    metrics_port: int
    log: Path
    proc: subprocess.Popen[bytes]
    command: list[str]
    env: dict[str, str]
    identity: str  # the chart's ServiceAccount as a user name, for `kubectl auth can-i --as`

    def another(self, log: Path, metrics_port: int) -> subprocess.Popen[bytes]:
        """A second replica: the same command and identity, its own /metrics port."""
        with log.open("w") as out:
            return subprocess.Popen(
                [*self.command, f"--metrics-port={metrics_port}"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, "POD_ID": self.env.get("POD_ID", "operator") + "-b"},
                cwd=log.parent,
                start_new_session=True,
            )

    def alive(self) -> None:
        """Fail at once, with the operator's log, when the operator process has exited."""
        if self.proc.poll() is not None:
            pytest.fail(f"the operator exited with {self.proc.returncode}\n{self.diagnose()}")

    def refused(self) -> list[tuple[str, str, str, int]]:
        return sorted(
            {
                (c.verb, c.group, c.resource, c.status)
                for c in self.proxy.calls
                if c.denied and (c.verb, c.group, c.resource) not in TOLERATED_DENIALS
            }
        )

    def diagnose(self) -> str:
        return f"refused calls: {self.refused()}\noperator log (tail):\n{self.log.read_text()[-4000:]}"


@pytest.fixture(params=["cluster", "namespaces"])
def operator_run(
    request: pytest.FixtureRequest,
    namespace: str,
    bin_dir: Path,
    kubeconfig: Path,
    kubectl,
    tmp_path: Path,
    wait_for,
) -> Iterator[OperatorRun]:
    """The chart installed into `namespace` and the operator running as its ServiceAccount.
    The param is the watch scope, `+kueue` adding `kueue.enabled=true`, `+lws`
    `leaderWorkerSet.enabled=true`."""
    scope, _, feature = request.param.partition("+")
    release = f"rbac-{uuid.uuid4().hex[:6]}"
    metrics_port = free_port()
    sets = [
        f"watch.scope={scope}",
        f"peering.name={release}",
        f"metrics.port={metrics_port}",
        "logFormat=plain",
    ]
    if scope == "namespaces":
        sets.append(f"watch.namespaces={{{namespace}}}")
    if feature == "kueue":
        sets.append("kueue.enabled=true")
    if feature == "lws":
        sets.append("leaderWorkerSet.enabled=true")
    set_args = [a for s in sets for a in ("--set", s)]
    # The chart's CRDs as they are in this checkout (the cluster may hold an older GRPOJob CRD).
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    helm(bin_dir, kubeconfig, "install", release, str(CHART), "--namespace", namespace, *set_args)
    manifest = helm(bin_dir, kubeconfig, "get", "manifest", release, "--namespace", namespace)
    docs = [d for d in yaml.safe_load_all(manifest) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod_spec = deployment["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    token = kubectl(
        "create", "token", pod_spec["serviceAccountName"], "-n", namespace, "--duration=2h"
    ).stdout.strip()
    server, ca = admin_server(kubeconfig)
    proxy = RecordingProxy(upstream=server, ca_file=ca)
    proxy.start()
    kc = token_kubeconfig(
        tmp_path / "operator.kubeconfig", f"http://127.0.0.1:{proxy.port}", token, namespace
    )
    log = tmp_path / "operator.log"
    # The chart's env, with the values its fieldRefs would give a pod of the Deployment.
    env = {**os.environ, "KUBECONFIG": str(kc), "HOME": str(tmp_path)}
    for var in container["env"]:
        if var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[var["name"]] = f"{release}-operator-0"
        elif "value" in var:
            env[var["name"]] = var["value"]
    command = [sys.executable, "-m", "grpo_operator.cli", *container["args"]]
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    try:
        yield OperatorRun(
            proxy=proxy,
            granted=granted(docs, namespace),
            metrics_port=metrics_port,
            log=log,
            proc=proc,
            command=command,
            env=env,
            identity=f"system:serviceaccount:{namespace}:{pod_spec['serviceAccountName']}",
        )
    finally:
        try:
            # While the operator still runs, so kopf can lift its finalizers: a job left behind
            # would keep the namespace Terminating forever.
            kubectl("delete", "grpojobs", "--all", "-n", namespace, "--timeout=60s", check=False, timeout=90)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proxy.stop()
        finally:
            helm(bin_dir, kubeconfig, "uninstall", release, "--namespace", namespace)
            kubectl("delete", "pv", fsx_volume(namespace), "--ignore-not-found", "--wait=false", check=False)


def fsx_volume(namespace: str) -> str:
    """This test's copy of the example's FSx PersistentVolume (cluster-scoped, so per test)."""
    return f"fsx-{namespace}"[:63]


def apply_example(
    namespace: str, kubectl, labels: dict[str, str] | None = None, rollout: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The FSx claim (a PV unique to this test), the PriorityClass and the p5 job (with extra
    `labels`, such as Kueue's queue name, and `rollout` fields over the example's)."""
    pv, pvc = (d for d in yaml.safe_load_all(FSX.read_text()) if d)
    pv["metadata"]["name"] = fsx_volume(namespace)
    pvc["spec"]["volumeName"] = pv["metadata"]["name"]
    pvc["metadata"]["namespace"] = namespace
    job = yaml.safe_load(EXAMPLE.read_text())
    priority = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": job["spec"]["scheduling"]["priorityClassName"]},
        "value": 1000,
        "description": "GPU training jobs (examples/p5-qwen3-30b-a3b.yaml)",
    }
    kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all([pv, pvc, priority]))
    if labels or rollout:
        job["metadata"].setdefault("labels", {}).update(labels or {})
        job["spec"]["rollout"].update(rollout or {})
        kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=yaml.safe_dump(job))
    else:
        kubectl("apply", "--server-side", "-n", namespace, "-f", str(EXAMPLE))
    return job


def read_job(k8s_api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    api = client.CustomObjectsApi(k8s_api)
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def wait_running(
    run: OperatorRun, k8s_api: client.ApiClient, wait_for: Callable[..., Any], namespace: str, name: str
) -> None:
    """Until the job's phase is Running; a dead operator fails at once instead of timing out."""

    last: dict[str, Any] = {}

    def running() -> bool:
        run.alive()
        last.update(status=read_job(k8s_api, namespace, name).get("status") or {})
        return last["status"].get("phase") == "Running"

    # 240 s: a peering that still shows a just-stopped operator of an earlier test pauses this one
    # until that peer's heartbeat expires ("Resuming operations after the pause")
    try:
        wait_for(running, what=f"{name} Running", timeout=240)
    except TimeoutError as e:
        raise TimeoutError(f"{e}; status: {last.get('status')}\n{run.diagnose()}") from None


def trainer_pods(k8s_api: client.ApiClient, namespace: str, job: str) -> list[client.V1Pod]:
    selector = f"grpo.dev/job={job},grpo.dev/role=trainer"
    return client.CoreV1Api(k8s_api).list_namespaced_pod(namespace, label_selector=selector).items


def test_operator_under_chart_identity_runs_and_restarts_a_job(
    operator_run: OperatorRun,
    namespace: str,
    kubectl,
    k8s_api: client.ApiClient,
    wait_for: Callable[..., Any],
    fail_pod: Callable[..., None],
) -> None:
    job = apply_example(namespace, kubectl)
    name = job["metadata"]["name"]
    applied_spec = read_job(k8s_api, namespace, name)["spec"]

    try:
        wait_running(operator_run, k8s_api, wait_for, namespace, name)
    except TimeoutError as e:
        pytest.fail(f"{e}\n{operator_run.diagnose()}")
    health = urllib.request.urlopen(f"http://127.0.0.1:{operator_run.metrics_port}/healthz", timeout=5)
    assert health.status == 200, "the chart's probes hit this endpoint"
    pods = trainer_pods(k8s_api, namespace, name)
    assert len(pods) == 2
    victim, victim_uid = pods[1].metadata.name, pods[1].metadata.uid

    def restarted() -> bool:
        operator_run.alive()
        status = read_job(k8s_api, namespace, name).get("status") or {}
        pods = trainer_pods(k8s_api, namespace, name)
        if not status.get("restarts"):
            # kwok may still be writing the pod's Running status when we fail it: fail it again
            # until the operator has seen the failure.
            old = [p for p in pods if p.metadata.uid == victim_uid and p.status.phase != "Failed"]
            if old:
                fail_while_present(fail_pod, namespace, victim)
        restarts = status.get("restarts") or 0
        fresh = [p for p in pods if p.metadata.labels.get("grpo.dev/attempt") == str(restarts)]
        return restarts >= 1 and status.get("phase") == "Running" and len(fresh) == 2

    try:
        wait_for(restarted, what=f"{name} back to Running after a gang restart", timeout=120)
    except TimeoutError as e:
        pods = kubectl("get", "pods", "-n", namespace, "-o", "wide", "--show-labels").stdout
        status = read_job(k8s_api, namespace, name).get("status")
        pytest.fail(f"{e}\npods:\n{pods}\nstatus: {status}\n{operator_run.diagnose()}")
    metrics = urllib.request.urlopen(
        f"http://127.0.0.1:{operator_run.metrics_port}/metrics", timeout=5
    ).read()
    restarts = read_job(k8s_api, namespace, name)["status"]["restarts"]
    assert f"grpo_operator_gang_restarts_total {restarts:.1f}".encode() in metrics

    # GitOps: the operator never writes spec, so what was applied is what is there.
    final = read_job(k8s_api, namespace, name)
    assert final["spec"] == applied_spec and final["metadata"]["generation"] == 1
    diff = kubectl("diff", "--server-side", "-n", namespace, "-f", str(EXAMPLE), check=False)
    assert diff.returncode == 0, f"drift after the operator ran:\n{diff.stdout}"

    assert not operator_run.refused(), f"the chart lacks permissions: {operator_run.diagnose()}"
    # Each job's token Secret is named per uid and created blind (409: it is there): the operator
    # may create Secrets and read none.
    for verb, answer in (("create", "yes"), ("get", "no"), ("list", "no"), ("watch", "no")):
        can = kubectl(
            "auth", "can-i", verb, "secrets", "-n", namespace, f"--as={operator_run.identity}", check=False
        )
        assert can.stdout.strip() == answer, f"can-i {verb} secrets: {can.stdout} {can.stderr}"
    used = {(c.verb, c.group, c.resource) for c in operator_run.proxy.calls}
    unused = operator_run.granted - used - set(NOT_EXERCISED)
    assert not unused, f"the chart grants permissions the operator never used: {sorted(unused)}"
    assert not used & set(NOT_EXERCISED), "NOT_EXERCISED lists a permission this run used: drop it"


@pytest.mark.parametrize("operator_run", ["namespaces"], indirect=True)
def test_a_missing_permission_is_caught(
    operator_run: OperatorRun,
    namespace: str,
    kubectl,
    k8s_api: client.ApiClient,
    wait_for: Callable[..., Any],
    fail_pod: Callable[..., None],
) -> None:
    """Take `delete pods` away from the chart's Role: the gang restart must hit a recorded 403."""
    rbac = client.RbacAuthorizationV1Api(k8s_api)
    (role,) = rbac.list_namespaced_role(
        namespace, label_selector="app.kubernetes.io/name=grpo-operator"
    ).items
    for rule in role.rules:
        if "pods" in rule.resources:
            rule.verbs = [v for v in rule.verbs if v != "delete"]
    rbac.replace_namespaced_role(role.metadata.name, namespace, role)
    job = apply_example(namespace, kubectl)
    name = job["metadata"]["name"]

    def running() -> bool:
        operator_run.alive()
        return (read_job(k8s_api, namespace, name).get("status") or {}).get("phase") == "Running"

    wait_for(running, what=f"{name} Running", timeout=120)
    victim = trainer_pods(k8s_api, namespace, name)[1].metadata.name

    def refused_delete() -> bool:
        operator_run.alive()
        pod = client.CoreV1Api(k8s_api).read_namespaced_pod(victim, namespace)
        if pod.status.phase != "Failed":
            fail_pod(namespace, victim, exit_code=1)
        return ("delete", "", "pods", 403) in operator_run.refused()

    wait_for(refused_delete, what="the operator's pod delete refused and recorded", timeout=120)


def fail_while_present(fail_pod: Callable[..., None], namespace: str, pod: str) -> None:
    """Fail `pod` with exit 1 unless it is gone: a gang restart can delete it between a test's
    read of the job's status and this call (the status patch follows the deletion)."""
    try:
        fail_pod(namespace, pod, exit_code=1)
    except client.ApiException as e:
        if e.status != 404:
            raise


def reconciles(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("grpo_operator_reconciles_total{")
    )


@pytest.mark.parametrize("operator_run", ["namespaces"], indirect=True)
def test_two_replicas_elect_one_leader_and_fail_over(
    operator_run: OperatorRun,
    namespace: str,
    kubectl,
    k8s_api: client.ApiClient,
    wait_for: Callable[..., Any],
    fail_pod: Callable[..., None],
    tmp_path: Path,
) -> None:
    """The chart's peering: of two replicas one acts, the other waits; stop the leader and the
    standby takes over the running job."""
    second_log, second_port = tmp_path / "second.log", free_port()
    second = operator_run.another(second_log, second_port)
    replicas = {
        operator_run.log: (operator_run.proc, operator_run.metrics_port),
        second_log: (second, second_port),
    }
    try:
        custom = client.CustomObjectsApi(k8s_api)

        def peers() -> int:
            objs = custom.list_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings")["items"]
            return sum(len(o.get("status") or {}) for o in objs)

        wait_for(lambda: peers() == 2, what="both replicas announced in the KopfPeering", timeout=60)
        time.sleep(3)  # the peers' watches see each other within milliseconds; leave slack
        job = apply_example(namespace, kubectl)
        name = job["metadata"]["name"]

        wait_running(operator_run, k8s_api, wait_for, namespace, name)
        counts = {log: reconciles(port) for log, (_, port) in replicas.items()}
        active = [log for log, n in counts.items() if n > 0]
        assert len(active) == 1, f"exactly one replica reconciles: {counts}"
        (leader_log,) = active
        (standby_log,) = set(replicas) - {leader_log}
        leader, _ = replicas[leader_log]
        standby, standby_port = replicas[standby_log]

        leader.send_signal(signal.SIGTERM)  # a rolling update or an eviction
        leader.wait(timeout=30)
        victim = trainer_pods(k8s_api, namespace, name)[1].metadata.name

        def restarted_by_standby() -> bool:
            assert standby.poll() is None, standby_log.read_text()[-3000:]
            status = read_job(k8s_api, namespace, name).get("status") or {}
            if status.get("restarts"):
                return True
            fail_while_present(fail_pod, namespace, victim)
            return False

        wait_for(restarted_by_standby, what="a gang restart done by the former standby", timeout=120)
        assert reconciles(standby_port) > 0
    finally:
        # The surviving replica lifts kopf's finalizers; then the second one goes.
        kubectl("delete", "grpojobs", "--all", "-n", namespace, "--timeout=60s", check=False, timeout=90)
        if second.poll() is None:
            second.send_signal(signal.SIGINT)
            second.wait(timeout=30)


@pytest.mark.parametrize("operator_run", ["namespaces+kueue"], indirect=True)
def test_the_chart_kueue_rules_are_what_a_queued_job_uses(
    operator_run: OperatorRun,
    namespace: str,
    kubectl,
    k8s_api: client.ApiClient,
    wait_for: Callable[..., Any],
    third_party_crds: Path,
) -> None:
    """With kueue.enabled the operator, under the chart's identity, takes a queued job through
    admission, eviction and a suspend (which gives its Workload back): no request is refused
    and every Kueue rule the chart grants is used."""
    custom = client.CustomObjectsApi(k8s_api)
    flavor = f"rbac-{namespace[-6:]}"
    body = {"apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor", "metadata": {"name": flavor}}
    custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {**body, "spec": {}})
    wpc = {"apiVersion": "/".join(KUEUE), "kind": "WorkloadPriorityClass", "metadata": {"name": flavor}}
    custom.create_cluster_custom_object(*KUEUE, "workloadpriorityclasses", {**wpc, "value": 100})
    try:
        labels = {"kueue.x-k8s.io/queue-name": "p5-queue", "kueue.x-k8s.io/priority-class": flavor}
        job = apply_example(namespace, kubectl, labels=labels)
        name = job["metadata"]["name"]
        workload = f"grpojob-{name}"

        def read() -> dict[str, Any]:
            operator_run.alive()
            return custom.get_namespaced_custom_object(*KUEUE, namespace, "workloads", workload)

        wait_for(read, what="the job's Workload", ignore=(client.ApiException,), timeout=60)
        assignments = [
            {"name": r, "flavors": {"nvidia.com/gpu": flavor}, "count": 2} for r in ("trainer", "rollout")
        ]
        admitted = {
            "admission": {"clusterQueue": "p5-gpus", "podSetAssignments": assignments},
            "conditions": [
                condition("QuotaReserved", True, "QuotaReserved", "QuotaReserved"),
                condition("Admitted", True, "Admitted", "Admitted"),
            ],
        }
        status = custom.patch_namespaced_custom_object_status
        status(*KUEUE, namespace, "workloads", workload, {"status": admitted})
        wait_running(operator_run, k8s_api, wait_for, namespace, name)
        # The gang rendered at zero replicas while queued gets its zone once admitted: without
        # one the first rank may take the only p5 of us-west-2b and the second waits forever.
        trainer = client.AppsV1Api(k8s_api).read_namespaced_stateful_set(f"{name}-trainer", namespace)
        assert trainer.spec.template.spec.node_selector["topology.kubernetes.io/zone"] == "us-west-2a"
        evicted = {
            "conditions": [*admitted["conditions"], condition("Evicted", True, "Preempted", "Preempted")]
        }
        status(*KUEUE, namespace, "workloads", workload, {"status": evicted})
        wait_for(lambda: read()["status"].get("admission") is None, what="admission handed back", timeout=120)
        patch = {"spec": {"runPolicy": {"suspend": True}}}
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch)

        def gone() -> bool:
            try:
                read()
                return False
            except client.ApiException as e:
                return e.status == 404

        wait_for(gone, what="the suspended job's Workload deleted", timeout=60)
    except TimeoutError as e:
        pytest.fail(f"{e}\n{operator_run.diagnose()}")
    finally:
        custom.delete_cluster_custom_object(*KUEUE, "resourceflavors", flavor)
        custom.delete_cluster_custom_object(*KUEUE, "workloadpriorityclasses", flavor)
    assert not operator_run.refused(), f"the chart lacks permissions: {operator_run.diagnose()}"
    used = {(c.verb, c.group, c.resource) for c in operator_run.proxy.calls}
    kueue_rules = {g for g in operator_run.granted if g[1] == KUEUE[0]}
    assert len(kueue_rules) == 8 and not kueue_rules - used, sorted(kueue_rules - used)


@pytest.mark.parametrize("operator_run", ["namespaces+lws"], indirect=True)
def test_the_chart_lws_rules_are_what_servers_spanning_nodes_use(
    operator_run: OperatorRun,
    namespace: str,
    kubectl,
    k8s_api: client.ApiClient,
    wait_for: Callable[..., Any],
    lws_controller: Path | None,
) -> None:
    """With leaderWorkerSet.enabled the operator, under the chart's identity, runs the p5 job with
    2-node rollout servers (rollout.nodesPerServer) as a LeaderWorkerSet: no request is refused and
    every LeaderWorkerSet rule the chart grants is used."""
    spanning = {
        "instanceType": "p5en.48xlarge", "nodesPerServer": 2, "tensorParallelSize": 1, "replicas": 2,
        "minReplicas": 1, "vllm": {"dataParallelSize": 16, "expertParallelSize": 16},
    }  # fmt: skip
    job = apply_example(namespace, kubectl, rollout=spanning)
    name = job["metadata"]["name"]
    try:
        wait_running(operator_run, k8s_api, wait_for, namespace, name)
        custom = client.CustomObjectsApi(k8s_api)
        lws = custom.get_namespaced_custom_object(
            LWS[0], LWS[1], namespace, "leaderworkersets", f"{name}-rollout"
        )
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    except TimeoutError as e:
        pytest.fail(f"{e}\n{operator_run.diagnose()}")
    assert not operator_run.refused(), f"the chart lacks permissions: {operator_run.diagnose()}"
    used = {(c.verb, c.group, c.resource) for c in operator_run.proxy.calls}
    lws_rules = {g for g in operator_run.granted if g[1] == LWS[0]}
    assert len(lws_rules) == 3 and not lws_rules - used, sorted(lws_rules - used)
