"""Issue 46, no silent wrong signal: how a step's episodes ended and which reward judgements ran out
of time travel from the rollout servers' answers into the step's record, status and /metrics; a step
that trains on nothing says why; and each warning is said once, by the one rule in api.signals."""

import io
import logging
from pathlib import Path

import pytest
from grpo_operator.api import signals
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_operator.api.report import StepReport
from grpo_operator.local.display import ProgressView
from grpo_trainer.batch import Rollouts, untrained_reason
from grpo_trainer.progress import ProgressReporter
from grpo_wire.protocol import Completion, PromptResult, RewardDetail
from rich.console import Console

from tests.support.progress import REPORT, progress_contract


def completion(reward: float, finish: str = "stop", timed_out: int = 0) -> Completion:
    details = [
        RewardDetail(name="math", weight=1.0, score=0.0, error="out of time", timed_out=True)
    ] * timed_out
    details += [RewardDetail(name="format", weight=0.1, score=1.0)]
    return Completion(
        text="x",
        token_ids=[1, 2],
        logprobs=[-0.1, -0.2],
        finish_reason=finish,
        reward=reward,
        reward_details=details,
    )


def rollouts() -> Rollouts:
    results = [
        PromptResult(
            prompt_id="a", prompt_token_ids=[5], completions=[completion(1.0), completion(0.0, "length")]
        ),
        PromptResult(
            prompt_id="b",
            prompt_token_ids=[6],
            completions=[completion(0.0, "length", timed_out=1), completion(0.0, "length")],
        ),
    ]
    return Rollouts.from_results(results, group_size=2, weight_version=1)


def test_the_rule_warns_on_any_timeout_and_on_most_episodes_cut() -> None:
    assert signals.warnings(reward_timeouts=0, cut_fraction=0.5, max_new_tokens=8) == []
    assert signals.warnings(reward_timeouts=None, cut_fraction=None, max_new_tokens=None) == []
    found = dict(signals.warnings(reward_timeouts=2, cut_fraction=0.75, max_new_tokens=8))
    assert set(found) == {signals.REWARD_TIMEOUTS, signals.CUT_BY_BUDGET}
    assert found[signals.REWARD_TIMEOUTS].startswith("2 reward judgement(s) ran out of time")
    assert (
        "75%" in found[signals.CUT_BY_BUDGET]
        and "spec.algorithm.maxNewTokens=8" in found[signals.CUT_BY_BUDGET]
    )


def test_how_episodes_ended_survives_the_broadcast_the_cut_and_the_concat() -> None:
    r = rollouts()
    assert r.outcome_metrics() == {
        "episodes_cut_by_budget": 3.0,
        "episodes_cut_fraction": 0.75,
        "reward_timeouts": 1.0,
    }
    back = Rollouts.from_bytes(r.to_bytes())
    assert (back.cut, back.reward_timeouts) == ([False, True, True, True], [0, 0, 1, 0])
    first = r.first_groups(1)
    assert first.outcome_metrics() == {
        "episodes_cut_by_budget": 1.0,
        "episodes_cut_fraction": 0.5,
        "reward_timeouts": 0.0,
    }
    both = Rollouts.concat([first, back])
    assert both.cut == [False, True, False, True, True, True] and sum(both.reward_timeouts or []) == 1
    by_hand = Rollouts(2, [[1]], [[2]], [[-0.1]], [0.0], weight_version=0)  # tests' own: nothing known
    assert by_hand.outcome_metrics() == {} and Rollouts.concat([by_hand, r]).cut is None


def test_a_step_with_no_advantage_says_why_in_words() -> None:
    r = rollouts()
    r.rewards = [0.0, 0.0, 1.0, 1.0]  # both groups alike within themselves
    algo = AlgorithmSpec(max_new_tokens=8)
    why = untrained_reason(r, algo)
    assert "each of the 2 group(s) scored all its 2 completions alike (group rewards 0, 1)" in why
    assert "75% of episodes were cut by spec.algorithm.maxNewTokens" in why
    assert "1 reward judgement(s) ran out of time" in why


def test_the_trainer_sums_timeouts_over_the_attempt_and_warns_once_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = ProgressReporter(progress_contract(), str(tmp_path / "p.jsonl"), in_cluster=False)
    metrics = {"loss": 0.1, "reward_timeouts": 2.0, "episodes_cut_fraction": 0.9}
    with caplog.at_level(logging.WARNING, logger="grpo_trainer.progress"):
        for step in (1, 2, 3):
            reporter.report(REPORT.model_copy(update={"step": step, "metrics": metrics}))
    reporter.close()
    lines = [StepReport.model_validate_json(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r.reward_timeouts_total for r in lines] == [2, 4, 6]
    assert (
        lines[-1].to_progress().reward_timeouts == 6 and lines[-1].to_progress().episodes_cut_fraction == 0.9
    )
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all(m.startswith("step 1: ") for m in said), said


def test_the_local_console_says_each_once_and_the_first_untrained_step() -> None:
    out = io.StringIO()
    view = ProgressView(Console(file=out, width=200), "job", max_new_tokens=8)
    untrained = {"untrained_reason": "alike", "trained_samples": 0, "reward_timeouts_total": 1}
    reports = [
        REPORT.model_copy(update={"step": s, "metrics": {"episodes_cut_fraction": 0.9}, **untrained})
        for s in (1, 2)
    ]
    view.update(view._state, reports)
    text = out.getvalue()
    assert text.count("warning: 1 reward judgement(s) ran out of time") == 1
    assert text.count("spec.algorithm.maxNewTokens=8") == 1
    assert text.count("note: step 1 trained on no completion: alike") == 1 and "step 2 trained" not in text
