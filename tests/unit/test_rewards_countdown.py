"""Built-in countdown reward (grpo_rollout.rewards.countdown)."""

import pytest
from grpo_rollout.rewards.countdown import FORMAT_SCORE, countdown, evaluate


@pytest.mark.parametrize(
    "completion, score",
    [
        ("<think>try</think><answer>(3 + 5) * 2</answer>", 1.0),
        ("3*5+2 = 17", FORMAT_SCORE),  # right numbers, wrong value
        ("(3+5)*2*2", 0.0),  # a number used twice
        ("3+5", 0.0),  # a number unused
        ("2/(5-5)+3", 0.0),  # division by zero
        ("__import__('os')", 0.0),  # not arithmetic
        ("", 0.0),
    ],
)
def test_countdown_scores(completion, score):
    assert countdown(["p"], [completion], numbers=[[3, 5, 2]], target=[16]) == [score]


def test_evaluate_allows_only_arithmetic():
    assert evaluate("-(2 - 8) / 3") == 2.0
    assert evaluate("2 ** 10") is None
    assert evaluate("abs(2)") is None


def test_missing_target_column_is_named():
    with pytest.raises(KeyError, match="'target'"):
        countdown(["p"], ["1+2"], numbers=[[1, 2]])
