"""Built-in countdown reward (grpo_rollout.rewards.builtin.countdown)."""

import pytest
from grpo_rollout.rewards.builtin.countdown import FORMAT_SCORE, MAX_EXPRESSION, countdown, evaluate


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
        ("<answer>1+1</answer> <answer>3 * 5 + 2</answer>", FORMAT_SCORE),  # the last tagged answer
        ("<answer>(3 + 5) * 2</answer><answer>unclosed", 1.0),
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


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize(
    "completion",
    [
        "<answer>" * 500_000,  # a regex would rescan to the end from each opening tag
        "(" * 10_000 + "3+5*2" + ")" * 10_000,  # the parser's nesting limit, past MAX_EXPRESSION
        "+".join(["3"] * (MAX_EXPRESSION // 2)),  # well-formed but long: never evaluated
    ],
    ids=["unclosed-tags", "deep-parens", "long-sum"],
)
def test_pathological_completions_score_zero_at_once(completion):
    assert countdown(["p"], [completion], numbers=[[3, 5, 2]], target=[16]) == [0.0]
