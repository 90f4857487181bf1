"""Built-in exact_match reward (grpo_rollout.rewards.builtin.exact_match)."""

import pytest
from grpo_rollout.rewards.builtin.exact_match import exact_match


def test_trimmed_completion_equal_to_answer_scores_one():
    completions = [" 12\n", "12.", "13", "12"]
    assert exact_match(["p"] * 4, completions, answer=["12", "12", "12", 12]) == [1.0, 0.0, 0.0, 1.0]


def test_missing_answer_value_scores_zero():
    assert exact_match(["p"], ["None"], answer=[None]) == [0.0]


def test_missing_answer_column_names_the_column():
    with pytest.raises(KeyError, match="needs the dataset column 'answer'"):
        exact_match(["p"], ["1"], solution=["1"])
