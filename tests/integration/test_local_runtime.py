"""The local runtime end to end: `grpo-operator run` with real rollout servers and trainer ranks.

Every test runs the real CLI in a subprocess against the tiny MoE model (built once per
session by `grpo-operator tiny-model`: fixture `tiny_model`, tests/integration/conftest.py), reading
the run's summary JSON, progress file and logs afterwards (`run_job`, tests/support/local_runtime.py,
which the failure, scaling and storage tests drive too).
"""

import signal
from pathlib import Path

import pytest
import yaml

from tests.support.local_runtime import EXAMPLE, Run, job_manifest, run_job

pytestmark = pytest.mark.slow


def test_runs_to_completion_with_summary_plot_and_no_leftovers(tmp_path: Path, tiny_model: Path) -> None:
    run = run_job(tmp_path, job_manifest(tiny_model))
    assert run.finish() == 0, run.output()
    summary = run.summary()
    assert set(summary) == {
        "steps", "reward_first", "reward_last", "samples_per_s", "clip_fraction_mean", "wall_s", "restarts",
        "resumed_from_step", "resumed_from", "eval_reward_first", "eval_reward_last",
        "turns_mean", "tool_calls_per_episode", "tool_errors", "masked_token_fraction",
        "episodes_cut_fraction_mean", "reward_timeouts", "untrained_steps",
    }  # fmt: skip
    assert summary["reward_timeouts"] == 0 and 0.0 <= summary["episodes_cut_fraction_mean"] <= 1.0
    assert summary["turns_mean"] is None and summary["masked_token_fraction"] is None  # single-turn
    assert summary["eval_reward_first"] is None and summary["eval_reward_last"] is None  # no eval set
    assert summary["steps"] == 4 and summary["restarts"] == 0 and summary["resumed_from_step"] is None
    assert summary["resumed_from"] is None and "trainer attempt 0: starting fresh" in run.output()
    assert 0.0 <= summary["reward_first"] <= 1.0 and 0.0 <= summary["reward_last"] <= 1.0
    assert summary["clip_fraction_mean"] in (0.0, None)  # one update per step: the ratio stays 1
    steps = run.steps()
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for s in steps:  # every step says what it trained on, and why when nothing (issue 46)
        m = s["metrics"]
        assert "loss" in m and s["trained_samples"] == round(m["kept"] * s["samples"]), s
        assert (s["untrained_reason"] is not None) == (s["trained_samples"] == 0) == (m["loss"] is None), s
        assert m["reward_timeouts"] == 0 and s["reward_timeouts_total"] == 0
        assert m["episodes_cut_by_budget"] == round(m["episodes_cut_fraction"] * s["samples"])
    assert summary["untrained_steps"] == sum(s["trained_samples"] == 0 for s in steps)
    # 10% of 4 steps rounds up to one step at each end; samples/s leaves step 1 (start-up) out
    assert (
        summary["reward_first"] == steps[0]["reward_mean"]
        and summary["reward_last"] == steps[-1]["reward_mean"]
    )
    expected_rate = 3 * 4 * 4 / (steps[-1]["time"] - steps[0]["time"])
    assert summary["samples_per_s"] == pytest.approx(expected_rate)
    versions = [s["weight_version"] for s in steps]
    assert versions == sorted(versions) and versions[-1] > versions[0], versions
    assert (run.workdir / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert {p.name for p in (run.workdir / "logs").iterdir()} >= {"rollout-0.log", "trainer-0.log"}
    assert run.pod_pids() == {}


def test_ctrl_c_stops_every_process(tmp_path: Path, tiny_model: Path) -> None:
    run = run_job(tmp_path, job_manifest(tiny_model, maxSteps=1000))
    run.wait_until("the first step", lambda: len(run.steps()) >= 1)
    assert run.pod_pids().get("trainer"), "the trainer should be running"
    run.popen.send_signal(signal.SIGINT)
    assert run.finish(timeout=120) == 128 + signal.SIGINT, run.output()
    assert run.pod_pids() == {}
    assert "stopped by SIGINT" in run.output()
    logs = run.workdir / "logs"
    assert "Traceback" not in (logs / "trainer-0.log").read_text()  # stopped, not crashed
    assert "Traceback" not in (logs / "rollout-0.log").read_text()


def test_reward_plugin_that_raises_scores_zero_and_the_job_goes_on(tmp_path: Path, tiny_model: Path) -> None:
    plugin = (
        "def explode(prompts, completions, **columns):\n    raise ValueError('plugin exploded on purpose')\n"
    )
    manifest = job_manifest(tiny_model, maxSteps=2)
    manifest["spec"]["reward"]["functions"] = [{"function": "exploding_reward:explode"}]
    run = run_job(tmp_path, manifest, files={"exploding_reward.py": plugin})
    assert run.finish() == 0, run.output()
    assert run.summary()["steps"] == 2
    assert all(s["reward_mean"] == 0.0 for s in run.steps())
    assert "plugin exploded on purpose" in (run.workdir / "logs" / "rollout-0.log").read_text()


def test_malformed_dataset_row_fails_with_file_and_line(tmp_path: Path, tiny_model: Path) -> None:
    rows = (tiny_model / "addition.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([*rows[:2], '{"prompt": "1+1=", "answer": ', *rows[2:]]) + "\n")
    manifest = job_manifest(tiny_model)
    manifest["spec"]["dataset"]["path"] = "bad.jsonl"  # relative: read from the job file's folder
    run = run_job(tmp_path, manifest)
    code = run.finish()
    assert code != 0
    assert f"{bad}:3" in run.output(), run.output()
    assert run.pod_pids() == {}


def test_missing_model_is_reported_before_any_process_starts(tmp_path: Path) -> None:
    manifest = job_manifest(tmp_path / "no-such-model")
    run = run_job(tmp_path, manifest)
    assert run.finish() == 2
    assert f"spec.model.path: {tmp_path / 'no-such-model'} does not exist" in run.output()
    assert not (run.workdir / "logs").exists()


def test_example_job_learns(tmp_path: Path, tiny_model: Path) -> None:
    """examples/tiny-local.yaml as shipped (the README's demo), on the session's tiny model."""
    (tmp_path / ".tiny").symlink_to(tiny_model)
    job_file = tmp_path / "tiny-local.yaml"
    job_file.write_text(EXAMPLE.read_text())
    run = Run(job_file, tmp_path / "work")
    assert run.finish(timeout=900) == 0, run.output()
    summary = run.summary()
    assert summary["steps"] == yaml.safe_load(EXAMPLE.read_text())["spec"]["algorithm"]["maxSteps"]
    assert summary["reward_last"] > summary["reward_first"] + 0.1, summary
    # the 20 held-out sums RL never trained on: scored at step 0, every 50 steps and at the end
    evals = [e for s in run.steps() for e in s["evals"]]
    assert [e["step"] for e in evals] == list(range(0, summary["steps"] + 1, 50)), evals
    assert all(e["prompts"] == 20 and e["k"] == 4 and 0 <= e["pass_at_k"] <= 1 for e in evals), evals
    assert summary["eval_reward_first"] == evals[0]["reward"]
    assert summary["eval_reward_last"] == evals[-1]["reward"]
    assert summary["eval_reward_last"] > summary["eval_reward_first"], evals
