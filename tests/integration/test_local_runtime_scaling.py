"""Rollout servers added and removed during a local run, by editing the job file's
`spec.rollout.replicas` as a cluster user edits the GRPOJob (`kubectl scale grpo/NAME`).

The real CLI runs the job; the test edits the file mid-run. The added server must be given work
only at the live weight version (its /metrics count answered /generate requests and no request it
was too old for; the trainer's log says it was caught up); the removed ones must stop, and no
prompt may be lost: every step is reported, in order, with all its completions.
"""

import json
import signal
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.local_runtime import Run, job_manifest, run_job

pytestmark = pytest.mark.slow
PROMPTS, GROUP = 4, 4


def generate_requests(url: str) -> dict[str, float]:
    """A server's /generate request counts by HTTP status code, from its /metrics."""
    try:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpo_rollout_requests_total{") and 'endpoint="/generate"' in line:
            code = line.split('code="', 1)[1].split('"', 1)[0]
            out[code] = float(line.rsplit(" ", 1)[1])
    return out


def rollout_indices(run: Run) -> set[str]:
    """The pod indices of the run's live rollout processes (a server's reward workers share its env)."""
    return {env.get("GRPO_POD_INDEX", "?") for _, cmd, env in run.processes() if "grpo_rollout" in cmd}


def scale(job_file: Path, replicas: int) -> None:
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["rollout"]["replicas"] = replicas
    job_file.write_text(yaml.safe_dump(manifest))


def test_rollout_servers_added_and_removed_mid_run(tmp_path: Path, tiny_model: Path) -> None:
    algorithm = {"promptsPerStep": PROMPTS, "groupSize": GROUP, "microBatchSize": 16, "maxStaleness": 1}
    manifest = job_manifest(tiny_model, maxSteps=100_000, **algorithm)
    manifest["spec"]["rollout"]["replicas"] = 2
    run = run_job(tmp_path, manifest)
    job_file, contract = tmp_path / "job.yaml", run.workdir / "job.json"
    try:
        run.wait_until("step 2", lambda: len(run.steps()) >= 2)
        scale(job_file, 3)
        run.wait_until(
            "rollout-2 in the contract",
            lambda: len(json.loads(contract.read_text())["rollout"]["endpoints"]) == 3,
        )
        added = json.loads(contract.read_text())["rollout"]["endpoints"][2]
        run.wait_until("rollout-2 to answer work", lambda: generate_requests(added).get("200", 0) >= 2)
        served = generate_requests(added)
        assert "409" not in served, f"rollout-2 was sent work its weights were too old for: {served}"
        trainer_log = (run.workdir / "logs" / "trainer-0.log").read_text()
        caught_up = (  # over HTTP, or (the torch engine's default) through the re-formed weight groups
            f"rollout server {added} is at weight version 0: sending it version",
            f"rollout server {added} joins the weight groups",
        )
        assert any(line in trainer_log for line in caught_up), trainer_log[-3000:]
        joined = [ln for ln in trainer_log.splitlines() if f"rollout server {added} joined" in ln]
        assert joined and "joined at weight version 0;" not in joined[0], joined  # a trained version

        at = len(run.steps())
        scale(job_file, 1)  # rollout-2 and rollout-1 go, highest index first
        run.wait_until("rollout-1 and rollout-2 stopped", lambda: rollout_indices(run) == {"0"}, timeout=120)
        run.wait_until("5 more steps on one server", lambda: len(run.steps()) >= at + 5, timeout=300)
        assert len(json.loads(contract.read_text())["rollout"]["endpoints"]) == 1
    finally:
        if run.popen.poll() is None:
            run.popen.send_signal(signal.SIGINT)
    assert run.finish(timeout=120) == 128 + signal.SIGINT, run.output()
    steps = run.steps()
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(s["samples"] == PROMPTS * GROUP for s in steps), [s["samples"] for s in steps]
    assert [s["position"] for s in steps] == [PROMPTS * s["step"] for s in steps]
    assert "rollout scaled from 2 to 3" in run.output() and "rollout scaled from 3 to 1" in run.output()
    assert run.pod_pids() == {}
