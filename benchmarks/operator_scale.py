"""Operator scale benchmark: N GRPOJobs on a real API server, and what the operator costs.

    KUBECONFIG=$(hack/cluster.sh kubeconfig) python benchmarks/operator_scale.py --jobs 200 --json out.json

Starts `grpo-operator operator` as a subprocess on a fresh namespace, creates N small
CPU GRPOJobs (one trainer pod each, so kwok's CPU nodes hold them all), and reports
seconds until every job has all its children, API writes per job until the jobs settle,
writes per minute in the steady state that follows (the operator's own counter, and the
API server's count of writes to the kinds it owns), reconcile passes in that window, and
the operator's RSS. Prints a table and writes {"jobs", "seconds_to_all_children",
"api_writes_per_job", "steady_state_writes_per_min", "operator_rss_mb", ...} to --json.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import yaml
from grpo_operator.api.job import GROUP, PLURAL, VERSION
from kubernetes import client, config

ROOT = Path(__file__).resolve().parents[1]
CHILDREN_PER_JOB = 12  # contract, 2 SAs, Role, RoleBinding, 2 Services, 2 StatefulSets, PDB, 2 NetPols
OWNED = ("grpojobs", "statefulsets", "configmaps", "services", "serviceaccounts", "roles", "rolebindings")
OWNED += ("poddisruptionbudgets", "networkpolicies", "secrets", "events", "pods")


def job(name: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GRPOJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "/models/tiny"},
            "dataset": {"path": "/data/prompts.jsonl"},
            "reward": {"functions": [{"builtin": "exact_match"}]},
            "trainer": {"replicas": 1, "processesPerPod": 1},
            "rollout": {"replicas": 0, "engine": "torch"},
        },
    }


def metric_sum(text: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        config.load_kube_config()
        self.api = client.ApiClient()
        self.core, self.apps = client.CoreV1Api(self.api), client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.ns = f"bench-{uuid.uuid4().hex[:6]}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc: subprocess.Popen | None = None

    def operator_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode()

    def apiserver_writes(self) -> float:
        """Writes the API server served to the kinds the operator owns (all clients)."""
        text = self.api.call_api("GET", f"{self.api.configuration.host}/metrics", header_params={})
        text.read()
        total = 0.0
        for line in text.data.decode().splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = line[line.index("{") + 1 : line.index("}")]
            fields = dict(kv.split("=", 1) for kv in labels.split('",') if "=" in kv)
            verb = fields.get("verb", "").strip('"')
            resource = fields.get("resource", "").strip('"')
            if verb in ("POST", "PUT", "PATCH", "DELETE", "APPLY", "CREATE", "UPDATE") and resource in OWNED:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def start_operator(self, log: Path) -> None:
        self._apply_crd()
        cmd = [
            sys.executable,
            "-m",
            "grpo_operator.cli",
            "operator",
            "-n",
            self.ns,
            "--metrics-port",
            str(self.port),
        ]
        cmd += ["--metrics-host", "127.0.0.1", "--resync-seconds", str(self.args.resync_seconds)]
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ)
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.operator_metrics()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"operator did not serve /metrics; see {log}")

    def _apply_crd(self) -> None:
        crd = yaml.safe_load((ROOT / "crds/grpojobs.grpo.dev.yaml").read_text())
        ext = client.ApiextensionsV1Api(self.api)
        try:
            ext.create_custom_resource_definition(crd)
        except client.ApiException as e:
            if e.status != 409:
                raise

    def count_children(self) -> int:
        sel = "app.kubernetes.io/managed-by=grpo-operator"
        sts = self.apps.list_namespaced_stateful_set(self.ns, label_selector=sel).items
        cms = self.core.list_namespaced_config_map(self.ns, label_selector=sel).items
        return len(sts) + len(cms)

    def phases(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for item in self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]:
            phase = (item.get("status") or {}).get("phase", "None")
            out[phase] = out.get(phase, 0) + 1
        return out

    def run(self) -> dict:
        n = self.args.jobs
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.ns)))
        log = Path(self.args.log or f"/tmp/{self.ns}-operator.log")
        self.start_operator(log)
        try:
            return self._measure(n, log)
        finally:
            if not self.args.keep:
                self._delete_jobs()
            self.proc.terminate()
            self.proc.wait(timeout=30)
            if not self.args.keep:
                self.core.delete_namespace(self.ns, propagation_policy="Background")

    def _delete_jobs(self) -> None:
        """Delete jobs while the operator runs: each carries kopf's finalizer."""
        self.custom.delete_collection_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)
        deadline = time.monotonic() + 300
        while self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]:
            if time.monotonic() > deadline:
                print(f"warning: jobs in {self.ns} still exist after 300 s", file=sys.stderr)
                return
            time.sleep(2)

    def _measure(self, n: int, log: Path) -> dict:
        t0 = time.monotonic()
        for i in range(n):
            self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, job(f"job-{i:04d}"))
        created = time.monotonic() - t0
        while self.count_children() < 3 * n:  # 2 StatefulSets + the contract ConfigMap per job
            if time.monotonic() - t0 > self.args.timeout:
                raise TimeoutError(f"children incomplete after {self.args.timeout}s; see {log}")
            time.sleep(1)
        to_children = time.monotonic() - t0
        # settle: every job has a phase and the operator has stopped writing for a while
        last, quiet_since = -1.0, time.monotonic()
        while time.monotonic() - quiet_since < self.args.settle_seconds:
            writes = metric_sum(self.operator_metrics(), "grpo_operator_api_writes_total{")
            if writes != last:
                last, quiet_since = writes, time.monotonic()
            time.sleep(2)
        settled = time.monotonic() - t0
        phases = self.phases()
        m0 = self.operator_metrics()
        a0 = self.apiserver_writes()
        time.sleep(self.args.steady_seconds)
        m1 = self.operator_metrics()
        a1 = self.apiserver_writes()
        minutes = self.args.steady_seconds / 60
        w = "grpo_operator_api_writes_total{"
        r = 'grpo_operator_reconciles_total{result="ok"}'
        return {
            "jobs": n,
            "seconds_to_create": round(created, 2),
            "seconds_to_all_children": round(to_children, 2),
            "seconds_to_settle": round(settled, 2),
            "api_writes_per_job": round(metric_sum(m0, w) / n, 2),
            "steady_state_writes_per_min": round((metric_sum(m1, w) - metric_sum(m0, w)) / minutes, 2),
            "steady_state_apiserver_writes_per_min": round((a1 - a0) / minutes, 2),
            "steady_state_reconciles_per_min": round((metric_sum(m1, r) - metric_sum(m0, r)) / minutes, 1),
            "operator_rss_mb": round(psutil.Process(self.proc.pid).memory_info().rss / 2**20, 1),
            "phases": phases,
            "resync_seconds": self.args.resync_seconds,
            "steady_seconds": self.args.steady_seconds,
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument(
        "--resync-seconds", type=float, default=30.0, help="operator resync (passes in the window)"
    )
    p.add_argument("--steady-seconds", type=float, default=60.0, help="length of the steady-state window")
    p.add_argument("--settle-seconds", type=float, default=15.0, help="quiet time that counts as settled")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--log", help="operator log file")
    p.add_argument("--keep", action="store_true", help="keep the namespace")
    args = p.parse_args()
    result = Bench(args).run()
    width = max(map(len, result))
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
