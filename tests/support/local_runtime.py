"""`grpo-operator run` as the local-runtime tests drive it: a small job manifest, the run as a
subprocess, and what it leaves in its work directory (progress, summary, logs, live processes)."""

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-local.yaml"


def job_manifest(model: Path, **algorithm: Any) -> dict[str, Any]:
    """A small GRPOJob: 1 rollout server, one trainer pod with 2 ranks at EP 2."""
    algo = {"groupSize": 4, "promptsPerStep": 4, "microBatchSize": 16, "maxSteps": 4, "maxNewTokens": 4}
    algo.update({"learningRate": 0.002, **algorithm})
    return {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPOJob",
        "metadata": {"name": "itest"},
        "spec": {
            "model": {"path": str(model), "dtype": "float32"},
            "dataset": {"path": str(model / "addition.jsonl")},
            "reward": {"functions": [{"builtin": "exact_match"}]},
            "algorithm": algo,
            "trainer": {"replicas": 1, "processesPerPod": 2, "expertParallelSize": 2, "epBackend": "gloo"},
            "rollout": {"replicas": 1, "engine": "torch"},
            "checkpoint": {"everySteps": 2},
            "runPolicy": {"backoffLimit": 2},
        },
    }


class Run:
    """One `grpo-operator run` subprocess and the files it leaves in its work directory."""

    def __init__(self, job_file: Path, workdir: Path) -> None:
        self.workdir = workdir
        self.summary_path = workdir.parent / "summary.json"
        self.out_path = workdir.parent / "run.out"
        cmd = [sys.executable, "-m", "grpo_operator.cli", "run", str(job_file)]
        cmd += ["--summary-json", str(self.summary_path), "--workdir", str(workdir)]
        with open(self.out_path, "wb") as out:
            self.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def steps(self) -> list[dict[str, Any]]:
        path = self.workdir / "progress.jsonl"
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in lines if not r.get("attempt_start")]  # step reports only

    def wait_until(self, what: str, cond: Callable[[], bool], timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.popen.poll() is not None:
                pytest.fail(
                    f"run ended (code {self.popen.returncode}) while waiting for {what}:\n{self.output()}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"gave up waiting for {what}:\n{self.output()}")
            time.sleep(0.1)

    def finish(self, timeout: float = 600) -> int:
        return self.popen.wait(timeout=timeout)

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def summary(self) -> dict[str, Any]:
        return json.loads(self.summary_path.read_text())

    def processes(self) -> list[tuple[int, str, dict[str, str]]]:
        """Live processes started for this run (their env names its contract): pid, command line, env."""
        marker = f"GRPO_CONTRACT={self.workdir / 'job.json'}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                if marker not in environ:
                    continue
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                status = (entry / "status").read_text()
            except OSError:
                continue
            if "zombie" not in status:
                env = dict(kv.decode(errors="replace").partition("=")[::2] for kv in environ if b"=" in kv)
                found.append((int(entry.name), cmdline, env))
        return found

    def pod_pids(self) -> dict[str, list[int]]:
        """Live processes of this run by role (rollout, trainer), launchers and ranks alike."""
        found: dict[str, list[int]] = {}
        for pid, cmdline, _ in self.processes():
            role = (
                "trainer"
                if "grpo_trainer" in cmdline
                else "rollout"
                if "grpo_rollout" in cmdline
                else "other"
            )
            found.setdefault(role, []).append(pid)
        return found


def run_job(tmp_path: Path, manifest: dict[str, Any], files: dict[str, str] | None = None) -> Run:
    """Write the manifest (and any files beside it, e.g. reward plugins) and start the run."""
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(manifest))
    return Run(job_file, tmp_path / "work")
