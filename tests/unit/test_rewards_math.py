"""Built-in math reward: final-answer extraction and numeric comparison (grpo_rollout.rewards.math_answer)."""

import pytest
from grpo_rollout.rewards.math_answer import extract_answer, math_answer, same_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so x = \\boxed{\\frac{3}{4}} done", "\\frac{3}{4}"),
        ("first \\boxed{1} then \\boxed{{2}}", "{2}"),
        ("work...\n#### 1,234", "1,234"),
        ("The answer is 42.", "42"),
        ("3 apples and 5 pears make 8", "8"),
        ("no digits here", None),
    ],
)
def test_extracts_the_final_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("0.5", "1/2", True),
        ("\\frac{1}{2}", "0.5", True),
        ("1,000", "1000", True),
        ("-3", "3", False),
        ("x+1", "x + 1", True),
    ],
)
def test_compares_numbers_exactly_and_text_normalised(a, b, same):
    assert same_answer(a, b) is same


def test_scores_each_completion_against_its_answer():
    completions = ["\\boxed{7}", "it is 8", "#### 2/4", "nothing"]
    assert math_answer(["p"] * 4, completions, answer=["7", 7, "0.5", "1"]) == [1.0, 0.0, 1.0, 0.0]
