"""The local runtime under failure: a trainer rank or a rollout server killed mid-run.

Real processes, killed with SIGKILL as a node loss or an OOM kill would: a lost trainer
rank must bring the whole gang back from its last checkpoint (step count continuing, one
restart in the summary); a lost rollout server must not stop the job (the trainer sends
its prompts to the other server while the runtime replaces it alone).
"""

import os
import signal
from pathlib import Path

import pytest

from tests.support.local_runtime import Run, job_manifest, run_job

pytestmark = pytest.mark.slow
EVERY = 3  # checkpoint interval of these runs
MAX_STEPS = 12


def test_killed_trainer_rank_restarts_the_gang_from_its_checkpoint(tmp_path: Path, tiny_model: Path) -> None:
    manifest = job_manifest(tiny_model, maxSteps=MAX_STEPS)
    manifest["spec"]["checkpoint"]["everySteps"] = EVERY
    run = run_job(tmp_path, manifest)
    run.wait_until("a step past the first checkpoint", lambda: len(run.steps()) >= EVERY + 2)
    ranks = [
        pid for pid, cmdline, env in run.processes() if "grpo_trainer rank" in cmdline and env["RANK"] == "1"
    ]
    assert len(ranks) == 1, run.processes()
    os.kill(ranks[0], signal.SIGKILL)

    assert run.finish() == 0, run.output()
    summary = run.summary()
    assert summary["restarts"] == 1 and summary["steps"] == MAX_STEPS, summary
    # the last attempt started from a sealed save: a multiple of everySteps, never step 0
    assert summary["resumed_from_step"] in range(EVERY, MAX_STEPS, EVERY), summary
    seq = [s["step"] for s in run.steps()]
    assert set(seq) == set(range(1, MAX_STEPS + 1)), seq
    resumed = [seq[i] for i in range(1, len(seq)) if seq[i] <= seq[i - 1]]
    assert len(resumed) <= 1, seq  # at most one rewind: the one restart
    if resumed:  # the gang went back to its last checkpoint, not to step 1
        assert resumed[0] > 1 and (resumed[0] - 1) % EVERY == 0, seq
    assert "restarting the trainer gang from its last checkpoint (1/2)" in run.output()
    # each attempt says where it starts, before its first step
    step = summary["resumed_from_step"]
    assert summary["resumed_from"].endswith(f"/step-{step:08d}"), summary
    assert "trainer attempt 0: starting fresh (no checkpoint to resume)" in run.output()
    assert f"trainer attempt 1: resumed from step {step} ({summary['resumed_from']})" in run.output()
    assert "attempt 1" in (run.workdir / "logs" / "trainer-0.log").read_text()
    assert run.pod_pids() == {}


def kill_rollout_server_mid_run(run: Run, index: int) -> Run:
    """SIGKILL rollout server `index` after a few steps; the job then ends with every step and no
    gang restart (the server is replaced alone)."""
    run.wait_until("a few steps", lambda: len(run.steps()) >= 3)
    servers = [
        pid
        for pid, cmdline, env in run.processes()
        if "grpo_rollout serve" in cmdline and env["GRPO_POD_INDEX"] == str(index)  # not its reward worker
    ]
    assert len(servers) == 1, run.processes()
    os.kill(servers[0], signal.SIGKILL)
    assert run.finish() == 0, run.output()
    summary = run.summary()
    assert summary["steps"] == MAX_STEPS and summary["restarts"] == 0, summary  # the gang never went down
    assert [s["step"] for s in run.steps()] == list(range(1, MAX_STEPS + 1))
    assert f"rollout-{index} was killed by SIGKILL" in run.output()
    return run


def test_killed_rollout_server_is_replaced_and_the_job_finishes(tmp_path: Path, tiny_model: Path) -> None:
    manifest = job_manifest(tiny_model, maxSteps=MAX_STEPS)
    manifest["spec"]["rollout"]["replicas"] = 2
    run = kill_rollout_server_mid_run(run_job(tmp_path, manifest), index=1)
    assert "restarting it alone" in run.output()
    assert run.pod_pids() == {}


@pytest.mark.parametrize("transport", ["collective", "http"])
def test_the_only_rollout_server_killed_is_caught_up_by_its_replacement_without_a_gang_restart(
    tmp_path: Path, tiny_model: Path, transport: str
) -> None:
    """With one rollout server, its loss leaves no server for a while: a weight version pushed
    meanwhile finds none ready, and the replacement starts from the model on disk, behind the live
    version, which generation's staleness bound refuses. Neither may cost the gang: the version goes
    to the replacement as it comes up (over HTTP the kept copy; over the collective transport a
    stream every rank joins while rank 0 waits for rollouts)."""
    manifest = job_manifest(tiny_model, maxSteps=MAX_STEPS)
    manifest["spec"]["rollout"]["weightSync"] = {"transport": transport}
    run = kill_rollout_server_mid_run(run_job(tmp_path, manifest), index=0)
    trainer = (run.workdir / "logs" / "trainer-0.log").read_text()
    if transport == "collective":  # the replacement came up at version 0 while the job was past it
        assert "which came up behind it" in trainer, trainer[-3000:]
    else:
        assert "are behind weight version" in trainer, trainer[-3000:]
