"""Held-out evaluation's pure parts (grpo_trainer.evaluation): when it runs, what it reports, and
that a bad eval set fails the job at start-up. The run itself is exercised end to end by
tests/integration/test_local_runtime.py (the demo example, whose held-out reward must rise)."""

from pathlib import Path

import pytest
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_operator.api.spec import DatasetSpec
from grpo_trainer.config import ConfigError
from grpo_trainer.evaluation import Evaluator, due, score


def test_runs_at_the_baseline_every_n_steps_and_after_the_last():
    assert [s for s in range(0, 26) if due(s, 10, 25)] == [0, 10, 20, 25]
    assert [s for s in range(0, 4) if due(s, 1, 3)] == [0, 1, 2, 3]


def test_reports_the_greedy_mean_and_the_mean_best_of_k():
    result = score(5, [1.0, 0.0, 0.0, 1.0], [[0.0, 1.0], [0.0, 0.0], [0.0, 0.5], [1.0, 1.0]], 2.0)
    assert (result.step, result.reward, result.k, result.prompts) == (5, 0.5, 2, 4)
    assert result.pass_at_k == pytest.approx((1.0 + 0.0 + 0.5 + 1.0) / 4)


def test_without_samples_there_is_no_pass_at_k():
    assert score(0, [0.25], [], 0.1).pass_at_k is None


def test_reads_the_held_out_set_with_the_training_prompt_field(tmp_path: Path):
    (tmp_path / "eval.jsonl").write_text('{"q": "1+1=", "answer": "2"}\n{"q": "2+2=", "answer": "4"}\n')
    dataset = DatasetSpec(
        path="/train.jsonl", prompt_field="q", eval={"path": str(tmp_path / "eval.jsonl"), "samples": 3}
    )
    evaluator = Evaluator.for_dataset(dataset, AlgorithmSpec(temperature=0.7, max_new_tokens=5))
    assert evaluator is not None
    assert [(p.id, p.text, p.columns) for p in evaluator.prompts] == [
        ("eval-0", "1+1=", {"answer": "2"}),
        ("eval-1", "2+2=", {"answer": "4"}),
    ]
    assert Evaluator.for_dataset(DatasetSpec(path="/train.jsonl"), AlgorithmSpec()) is None


def test_a_bad_row_in_the_held_out_set_fails_with_file_and_line(tmp_path: Path):
    (tmp_path / "eval.jsonl").write_text('{"prompt": "1+1="}\n{"answer": "4"}\n')
    dataset = DatasetSpec(path="/train.jsonl", eval={"path": str(tmp_path / "eval.jsonl")})
    with pytest.raises(ConfigError, match=r"eval\.jsonl:2"):
        Evaluator.for_dataset(dataset, AlgorithmSpec())
