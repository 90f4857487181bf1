"""Rank 0's step reports: one StepReport JSON line per step, read back by the local runtime, and
the GRPOJob's status.progress made from the same report."""

import json
from pathlib import Path

import pytest
from grpo_operator.api.report import ENV_PROGRESS_FILE, EvalScore, StepReport
from grpo_operator.api.status import Progress
from grpo_operator.local.progress import ProgressLog
from grpo_trainer.progress import ProgressReporter

from tests.support.progress import REPORT, progress_contract


def test_reports_append_to_the_progress_file_and_the_runtime_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv(ENV_PROGRESS_FILE, str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    reporter = ProgressReporter.from_env(progress_contract())
    reporter.report(REPORT)
    reporter.report(REPORT.model_copy(update={"step": 4, "reward_mean": 0.5}))
    reporter.close()
    with open(path, "a") as f:  # a library's stray print and a torn line are skipped, not fatal
        f.write("loading weights...\n" + '{"step": 5, "rew')
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines[:2]] == [3, 4]
    records = ProgressLog(path).poll()
    assert [(r.step, r.reward_mean) for r in records] == [(3, 0.4), (4, 0.5)]
    assert records[0] == REPORT


def test_each_report_carries_the_wait_share_of_the_last_steps(tmp_path: Path) -> None:
    reporter = ProgressReporter(progress_contract(), str(tmp_path / "p.jsonl"), in_cluster=False)
    waits = [0.5] * 3 + [0.0] * (ProgressReporter.WAIT_WINDOW + 2)  # 1 s steps
    for step, wait in enumerate(waits, start=1):
        reporter.report(REPORT.model_copy(update={"step": step, "rollout_s": wait, "step_s": 1.0}))
    reporter.close()
    shares = [r.rollout_wait_fraction for r in ProgressLog(tmp_path / "p.jsonl").poll()]
    assert shares[:3] == [0.5, 0.5, 0.5]
    assert shares[3] == pytest.approx(1.5 / 4) and shares[-1] == 0.0  # the window forgets old waits


def test_a_non_finite_metric_survives_the_round_trip_as_unknown() -> None:
    line = REPORT.model_copy(update={"metrics": {"kl": float("nan")}}).model_dump_json()
    assert StepReport.model_validate_json(line).metrics == {"kl": None}


def test_status_progress_comes_from_the_report_and_every_field_is_written() -> None:
    progress = REPORT.to_progress()
    unset = [name for name in Progress.model_fields if getattr(progress, name) is None]
    assert unset == []  # a Progress field nothing fills in would be an always-empty dashboard panel
    assert progress.rollout_seconds == 0.1 and progress.train_seconds == 0.3
    assert progress.ep_all_to_all_seconds == 0.05 and progress.tokens_per_second == 900.0
    assert progress.ep_backend == "nccl" and progress.wire()["epBackend"] == "nccl"
    assert progress.updated_at == "2023-11-14T22:13:20+00:00"
    assert (progress.eval_reward, progress.eval_pass_at_k, progress.eval_step) == (0.3, 0.75, 3)  # newest


def test_a_report_without_an_evaluation_leaves_the_last_one_in_status() -> None:
    wire = REPORT.model_copy(update={"evals": []}).to_progress().wire()
    assert not {"evalReward", "evalPassAtK", "evalStep"} & set(wire)  # the merge patch keeps the old ones


def test_a_report_with_a_misspelt_field_is_refused() -> None:
    with pytest.raises(ValueError, match="gen_wait_s"):
        StepReport.model_validate({**REPORT.model_dump(), "gen_wait_s": 0.1})


def test_without_a_progress_file_lines_go_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    reporter = ProgressReporter(progress_contract(), None, in_cluster=False)
    reporter.report(REPORT)
    reporter.close()
    assert StepReport.model_validate_json(capsys.readouterr().out) == REPORT


def test_a_cluster_without_credentials_never_stops_the_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # in_cluster config cannot load
    reporter = ProgressReporter(progress_contract(), str(tmp_path / "p.jsonl"), in_cluster=True)
    reporter.report(REPORT)
    reporter.close()
    assert StepReport.model_validate_json((tmp_path / "p.jsonl").read_text()) == REPORT


def test_summary_means_the_clip_fraction_of_the_steps_that_trained() -> None:
    from grpo_operator.local.progress import summarize

    clipped = [
        REPORT.model_copy(update={"step": s, "metrics": {"clip_frac": c}}) for s, c in ((1, 0.1), (2, 0.3))
    ]
    idle = REPORT.model_copy(update={"step": 3, "metrics": {"kept": 0.0}})  # every group saturated
    assert summarize([*clipped, idle], wall_s=1.0, restarts=0)["clip_fraction_mean"] == pytest.approx(0.2)
    assert summarize([idle], wall_s=1.0, restarts=0)["clip_fraction_mean"] is None


def test_summary_takes_the_first_and_last_evaluation_and_a_rerun_step_its_newest() -> None:
    from grpo_operator.local.progress import summarize

    def at(step: int, reward: float) -> EvalScore:
        return EvalScore(step=step, reward=reward, k=0, prompts=20, seconds=1.0)

    steps = [
        REPORT.model_copy(update={"step": 1, "evals": [at(0, 0.1)]}),
        REPORT.model_copy(update={"step": 2, "evals": [at(2, 0.9)]}),  # lost: the gang restarted
        REPORT.model_copy(update={"step": 2, "evals": [at(2, 0.4)]}),
        REPORT.model_copy(update={"step": 3, "evals": []}),
    ]
    summary = summarize(steps, wall_s=1.0, restarts=1)
    assert (summary["eval_reward_first"], summary["eval_reward_last"]) == (0.1, 0.4)
    no_eval = summarize([REPORT.model_copy(update={"evals": []})], wall_s=1.0, restarts=0)
    assert no_eval["eval_reward_first"] is None and no_eval["eval_reward_last"] is None


def test_the_plot_draws_the_held_out_curves_beside_the_training_reward(tmp_path: Path) -> None:
    from grpo_operator.local.progress import plot_rewards

    reports = [REPORT.model_copy(update={"step": s, "evals": []}) for s in range(1, 4)]
    plain = plot_rewards(reports, tmp_path / "plain.png", "t")
    reports[0] = REPORT.model_copy(update={"step": 1})  # carries evaluations at steps 0 and 3
    both = plot_rewards(reports, tmp_path / "both.png", "t")
    assert plain is not None and both is not None
    assert both.read_bytes()[:4] == b"\x89PNG" and both.read_bytes() != plain.read_bytes()
