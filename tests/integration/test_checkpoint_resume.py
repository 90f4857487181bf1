"""Checkpoints of a real trainer gang: S3, SIGKILL mid-save, resharding, fallback, per-pod roots.

The gangs are `python -m grpo_trainer train` processes (gloo) against a real rollout server and,
for S3, moto's S3 server process (fixture `s3_server`), as in test_trainer_run.py (the harness:
tests/support/trainer_run.py). Runs use maxStaleness 0, so each step samples from exactly the
policy the trainer holds, with a seed that depends only on the job seed and the step: an
uninterrupted run and a resumed one see the same prompts and the same sampling seeds, and differ
only by float rounding.

"Within noise", measured on this CPU: a resume at the same shape (EP 2 → EP 2) reproduces the
uninterrupted run's losses and rewards exactly (same files, same RNG, same reduction order). A
resharded resume (EP 2 → 1 rank, EP 1) changes the order of float sums (one rank sums every
micro-batch; the all-to-all and gradient all-reduce are gone), about 1e-7 relative per step; so
its per-step loss must stay within 1e-3 absolute of the uninterrupted run's and its rewards
within 0.1 (a flipped sampled token among 16 completions moves the mean reward by 1/16).
"""

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_trainer.checkpoint.saver import ENV_SEAL_DELAY

from tests.support import trainer_run as gang
from tests.support.ports import free_port
from tests.support.trainer_run import (
    assert_exported,
    attempt_starts,
    children,
    finish,
    log_tail,
    progress,
    start_trainer,
)

pytestmark = pytest.mark.slow
tiny, launch, server = gang.tiny, gang.launch, gang.server  # the harness's fixtures, by name
STEPS = 6
LOSS_TOL, REWARD_TOL = 1e-3, 0.1


def contract(
    work: Path, tiny: Path, port: int, *, ckpt: str, pods: int = 1, ranks: int = 2, ep: int = 2,
    max_steps: int = STEPS, resume_from: str | None = None, keep_last: int = 2, master_port: int = 0,
    export_every: int | None = None,
) -> Path:  # fmt: skip
    spec: dict[str, Any] = {
        "model": {"path": str(tiny), "dtype": "float32"},
        "dataset": {"path": str(tiny / "addition.jsonl")},
        "reward": {"functions": [{"builtin": "exact_match"}]},
        "algorithm": {"groupSize": 4, "promptsPerStep": 4, "microBatchSize": 4, "maxNewTokens": 4,
                      "learningRate": 1e-3, "maxStaleness": 0, "maxSteps": max_steps},
        "trainer": {"replicas": pods, "processesPerPod": ranks // pods, "expertParallelSize": ep,
                    "epBackend": "gloo"},
        "rollout": {"replicas": 1, "engine": "torch"},
        "checkpoint": {"path": ckpt, "everySteps": 2, "keepLast": keep_last},
    }  # fmt: skip
    if resume_from:
        spec["checkpoint"]["resumeFrom"] = resume_from
    if export_every:
        spec["checkpoint"]["exportEverySteps"] = export_every
    job = GRPOJob.model_validate({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob",
                                  "metadata": {"name": "t"}, "spec": spec})  # fmt: skip
    ports = render.LocalPorts(trainer_master_port=master_port or free_port(), rollout_ports=(port,))
    c = render.contract(job, name="t", namespace="local", uid="u", local_ports=ports)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "job.json"
    path.write_text(c.model_dump_json(by_alias=True))
    return path


def trajectory(work: Path) -> dict[int, tuple[float, float]]:
    """(loss, mean reward) per step. A step whose every group drew one reward for all its samples keeps
    none (metrics.kept 0) and trains nothing: no loss is reported, it counts as 0 here (seen at step 4
    of the uninterrupted run on this machine's torch build); any other step must report its loss."""

    return {r["step"]: step_point(r) for r in progress(work)}


def step_point(record: dict) -> tuple[float, float]:
    m = record["metrics"]
    # a step that trained on nothing says so: trained_samples 0 and loss null (issue 46)
    return (0.0 if record["trained_samples"] == 0 else m["loss"]), record["reward_mean"]


def run_to_end(c: Path, work: Path, pods: int = 1) -> None:
    procs = [start_trainer(c, work, pod) for pod in range(pods)]
    assert [finish(p, work) for p in procs] == [0] * pods, log_tail(work)


def test_s3_gang_killed_mid_save_resumes_from_the_last_sealed_save_at_ep2_and_at_ep1(
    server, tiny: Path, tmp_path: Path, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, _ = server
    base = tmp_path / "base"
    run_to_end(contract(base, tiny, port, ckpt=str(tmp_path / "base-ckpt")), base)
    expected = trajectory(base)
    assert sorted(expected) == list(range(1, STEPS + 1))

    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    root = s3_server.make_bucket("ckpt-resume") + "/runs"
    job_dir = f"{root}/local/t-u"  # <path>/<namespace>/<name>-<uid>
    fs = s3_server.fs()
    killed = tmp_path / "killed"
    monkeypatch.setenv(ENV_SEAL_DELAY, "6")  # each save stays unsealed 6 s after its files are written
    proc = start_trainer(contract(killed, tiny, port, ckpt=root, max_steps=400), killed)
    monkeypatch.delenv(ENV_SEAL_DELAY)
    in_flight = f"{job_dir[5:]}/step-00000004"
    deadline = time.monotonic() + 240
    while not (
        fs.exists(f"{job_dir[5:]}/step-00000002/meta.json") and fs.exists(f"{in_flight}/rank-00001.json")
    ):
        assert time.monotonic() < deadline and proc.poll() is None, log_tail(killed)
        fs.invalidate_cache()
        time.sleep(0.2)
    for pid in [*children(proc.pid), proc.pid]:  # the whole pod, no chance to finish anything
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()
    assert not fs.exists(f"{in_flight}/meta.json")  # the killed save was never sealed
    assert max(r["step"] for r in progress(killed)) >= 4  # training did not wait for the save

    # the same checkpoint at 1 rank, EP = 1, through resumeFrom (another job, its own folder)
    ep1 = tmp_path / "ep1"
    c = contract(
        ep1, tiny, port, ckpt=str(tmp_path / "ep1-ckpt"), ranks=1, ep=1, resume_from=root + "/local/t-u"
    )
    run_to_end(c, ep1)
    resharded = trajectory(ep1)
    assert progress(ep1)[0]["resumed_from_step"] == 2
    # said before the first step, with the save's path: resumeFrom named the old job's folder
    assert [(a["resumed_from_step"], a["resumed_from"]) for a in attempt_starts(ep1)] == [
        (2, root + "/local/t-u/step-00000002")
    ]
    assert sorted(resharded) == list(range(3, STEPS + 1))

    # the killed job itself, same shape: resumes from step 2, overwrites the unsealed step 4
    run_to_end(contract(killed, tiny, port, ckpt=root), killed)
    resumed = [r for r in progress(killed) if r.get("resumed_from_step") == 2]
    assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
    fs.invalidate_cache()
    assert fs.exists(f"{job_dir[5:]}/step-00000006/meta.json") and fs.exists(
        f"{job_dir[5:]}/final/config.json"
    )

    for step in range(3, STEPS + 1):
        same = step_point(resumed[step - 3])
        assert same == expected[step], f"step {step}: EP2 resume {same} vs uninterrupted {expected[step]}"
        loss, reward = resharded[step]
        assert abs(loss - expected[step][0]) <= LOSS_TOL, (step, loss, expected[step])
        assert abs(reward - expected[step][1]) <= REWARD_TOL, (step, reward, expected[step])
    dl = max(abs(resharded[s][0] - expected[s][0]) for s in range(3, STEPS + 1))
    dr = max(abs(resharded[s][1] - expected[s][1]) for s in range(3, STEPS + 1))
    print(f"\nEP1 resume vs uninterrupted, steps 3-{STEPS}: max |Δloss| {dl:.2e}, max |Δreward| {dr:.3f}")


def test_two_pods_with_their_own_roots_each_write_their_shards(server, tiny: Path, tmp_path: Path) -> None:
    """Pod-local roots (what a multi-pod job on the default path would have; the API refuses it):
    every rank still writes its own shards, none waits for a folder another pod made, and the two
    roots together are one complete checkpoint that a 1-rank job resumes from."""
    port, _ = server
    work = tmp_path / "pods"
    roots = [tmp_path / "pod0-root", tmp_path / "pod1-root"]
    master = free_port()
    contracts = [
        contract(work / f"pod{i}", tiny, port, ckpt=str(roots[i]), pods=2, max_steps=2, master_port=master)
        for i in (0, 1)
    ]
    procs = [start_trainer(contracts[i], work, pod=i) for i in (0, 1)]
    assert [finish(p, work) for p in procs] == [0, 0], log_tail(work)
    saves = [r / "local" / "t-u" / "step-00000002" for r in roots]
    assert sorted(p.name for p in saves[0].iterdir()) == ["meta.json", "rank-00000.distcp", "rank-00000.json"]
    assert sorted(p.name for p in saves[1].iterdir()) == ["rank-00001.distcp", "rank-00001.json"]
    for f in saves[1].iterdir():  # what a shared store would have held: both pods' files together
        (saves[0] / f.name).write_bytes(f.read_bytes())
    one = tmp_path / "one"
    c = contract(one, tiny, port, ckpt=str(tmp_path / "one-ckpt"), ranks=1, ep=1, max_steps=3,
                 resume_from=str(saves[0]))  # fmt: skip
    run_to_end(c, one)
    assert [(r["step"], r["resumed_from_step"]) for r in progress(one)] == [(3, 2)]


def test_exports_and_a_damaged_newest_save_falls_back_to_the_one_before_with_a_warning(
    server, tiny: Path, tmp_path: Path
) -> None:
    port, _ = server
    work = tmp_path / "w"
    run_to_end(contract(work, tiny, port, ckpt=str(tmp_path / "ck"), max_steps=4, export_every=2), work)
    job_dir = tmp_path / "ck" / "local" / "t-u"
    assert sorted(p.name for p in (job_dir / "export").iterdir()) == ["step-00000002", "step-00000004"]
    assert_exported(job_dir / "export" / "step-00000004", tiny)  # every expert, loadable, trained
    newest = tmp_path / "ck" / "local" / "t-u" / "step-00000004" / "rank-00001.distcp"
    raw = bytearray(newest.read_bytes())
    raw[-5] ^= 0x40  # one flipped bit in rank 1's shard
    newest.write_bytes(bytes(raw))
    before = len(progress(work))
    run_to_end(contract(work, tiny, port, ckpt=str(tmp_path / "ck"), max_steps=5), work)
    after = progress(work)[before:]
    assert [r["step"] for r in after] == [3, 4, 5] and {r["resumed_from_step"] for r in after} == {2}
    assert "step-00000004 is unreadable" in after[0]["checkpoint_warning"]
    assert (
        "checksum mismatch" in after[0]["checkpoint_warning"]
        or "another rank" in after[0]["checkpoint_warning"]
    )
    assert after[1]["checkpoint_warning"] is None  # said once; the log keeps it
    assert "falling back to the save before it" in (work / "trainer.log").read_text()
    json.dumps(after)  # reports stay plain JSON
