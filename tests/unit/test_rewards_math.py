"""Built-in math reward: final-answer extraction and numeric comparison (grpo_rollout.rewards.math_answer).

The worst cases are answers a model can write that once took hours (`1e999999999` expanded to a
billion-digit integer); each must now finish at once and still be scored exactly. Their timeout
is a generous does-not-hang bound, enforced from a thread because a stuck big-integer operation
never returns to the interpreter for a signal to land.
"""

import sys

import pytest
from grpo_rollout.rewards.math_answer import MAX_TEXT, extract_answer, math_answer, same_answer, to_number


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
        ("1.5e3", "1500", True),
        ("\\dfrac{3}{4}", "0.75", True),
        ("-.5", "-1/2", True),
        ("+2", "2", True),
        ("1e999", "1" + "0" * 999, True),  # exact at the bounds
        ("\\frac{1}{0}", "0", False),
        ("2^{10}", "1024", False),  # text: nothing is evaluated
    ],
)
def test_compares_numbers_exactly_and_text_normalised(a, b, same):
    assert same_answer(a, b) is same


def test_scores_each_completion_against_its_answer():
    completions = ["\\boxed{7}", "it is 8", "#### 2/4", "nothing"]
    assert math_answer(["p"] * 4, completions, answer=["7", 7, "0.5", "1"]) == [1.0, 0.0, 1.0, 0.0]


LONG_RATIO = "1" * 600 + "/" + "7" * 600  # past MAX_NUMBER: compared as text
WORST_CASES = [  # (completion, the answer extracted from it)
    ("\\boxed{1e999999999}", "1e999999999"),
    ("\\boxed{-1e-999999999}", "-1e-999999999"),
    ("\\boxed{\\frac{1e999999999}{3}}", "\\frac{1e999999999}{3}"),
    ("The answer is 1E+999999999.", "1E+999999999"),
    ("#### 10**10**10", "10**10**10"),
    ("\\boxed{10^{10^{10}}}", "10^{10^{10}}"),
    ("\\boxed{" + "9" * 1_000_000 + "}", "9" * (MAX_TEXT - 1)),  # read from the tail: the last number
    ("\\boxed{" + LONG_RATIO + "}", LONG_RATIO),
    ("0." + "0" * 1_000_000 + "1", "0" * (MAX_TEXT - 1) + "1"),  # a long digit string
    ("\\boxed{" + "{" * 40_000 + "1" + "}" * 40_001, "{" * 40_000 + "1" + "}" * 40_000),  # deep nesting
    ("\\boxed{" * 200_000, None),  # never closed
    ("x" * 50_000_000 + " so the answer is 7", "7"),  # a giant completion
]


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize(
    "completion, extracted", WORST_CASES, ids=lambda c: f"{str(c)[:20]}...{len(c or '')}"
)
def test_worst_case_answers_are_scored_at_once_and_exactly(completion, extracted):
    assert extract_answer(completion) == extracted
    assert math_answer(["p"], [completion], answer=["2"]) == [0.0]
    if extracted is not None:  # the same answer, written the same way, is right (compared as text)
        assert math_answer(["p"], [completion], answer=[extracted]) == [1.0]


@pytest.mark.timeout(60, method="thread")
def test_numbers_stay_bounded_when_the_integer_digit_limit_is_lifted():
    # A reward in the same worker may lift Python's 4300-digit guard; the parser's own bounds hold.
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        assert to_number("9" * 10_000_000) is None
        assert to_number("1e999999999") is None
        assert to_number("1" + "0" * 999) == 10**999
    finally:
        sys.set_int_max_str_digits(before)


def test_only_the_tail_of_a_long_completion_is_read():
    assert extract_answer("\\boxed{3}" + " " * MAX_TEXT) is None
    assert extract_answer("\\boxed{3}" + " " * (MAX_TEXT - 20)) == "3"
