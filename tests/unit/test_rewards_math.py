"""Built-in math reward (grpo_rollout.rewards.builtin.math_answer): answer extraction, numbers, math-verify.

Answers are written the way real math datasets write them: GSM8K's `#### 72` and MATH's
`\\boxed{...}` LaTeX, with equivalent and non-equivalent forms of the same gold answer.
The worst cases are answers a model can write that once took hours (`1e999999999` expanded to a
billion-digit integer, towers of exponents SymPy would evaluate); each must come back with a
verdict. Their pytest timeout is a generous does-not-hang bound, enforced from a thread because a
stuck big-integer operation never returns to the interpreter for a signal to land; the batch of
them also goes through the real reward sandbox, where the job's reward timeout is the last word.
Symbolic comparisons that must agree get a generous SymPy budget, so a loaded machine cannot
turn them into misses.
"""

import sys

import pytest
from grpo_operator.api.spec import RewardSpec
from grpo_rollout.rewards.builtin.math_answer import (
    MAX_TEXT,
    extract_answer,
    math_answer,
    same_answer,
    to_number,
)
from grpo_rollout.rewards.scorer import RewardScorer

GENEROUS_S = 60.0  # SymPy's budget where a verdict of "equal" is asserted


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
    ],
)
def test_compares_numbers_exactly_and_text_normalised(a, b, same):
    assert same_answer(a, b) is same


@pytest.mark.parametrize(
    "predicted, gold",
    [  # MATH-style gold answers, and a model's equivalent way of writing each
        ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"),
        ("\\sqrt{3}/2", "\\frac{\\sqrt{3}}{2}"),
        ("sqrt(3)/2", "\\frac{\\sqrt{3}}{2}"),
        ("2^{10}", "1024"),
        ("\\sqrt{20}", "2\\sqrt{5}"),
        ("\\frac{\\pi}{2}", "\\pi/2"),
        ("(x+2)(x+5)", "x^2+7x+10"),
        ("(3,-1)", "(3, -1)"),
        ("\\{2,1\\}", "\\{1,2\\}"),
        ("2.25", "\\dfrac{9}{4}"),
        ("90", "90^\\circ"),
        ("C", "\\text{(C)}"),
        ("x = 5", "5"),
    ],
)
def test_equivalent_forms_agree(predicted, gold):
    assert same_answer(predicted, gold, seconds=GENEROUS_S)


@pytest.mark.parametrize(
    "predicted, gold",
    [
        ("\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt{3}}{2}"),
        ("(-1,3)", "(3,-1)"),
        ("(x+2)(x+6)", "x^2+7x+10"),
        ("5\\sqrt{2}", "2\\sqrt{5}"),
        ("1.41", "\\sqrt{2}"),
        ("2^{11}", "1024"),
        ("\\{1,3\\}", "\\{1,2\\}"),
        ("D", "\\text{(C)}"),
    ],
)
def test_different_answers_disagree(predicted, gold):
    assert not same_answer(predicted, gold, seconds=GENEROUS_S)


def test_scores_each_completion_against_its_answer():
    completions = ["\\boxed{7}", "it is 8", "#### 2/4", "nothing"]
    assert math_answer(["p"] * 4, completions, answer=["7", 7, "0.5", "1"]) == [1.0, 0.0, 1.0, 0.0]


def test_scores_gsm8k_and_math_style_completions():
    completions = [
        "She sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\n#### 18",  # GSM8K
        "Half of 2,160 is 1,080.\n#### 1,080",
        "So she has 17 left.\n#### 17",
        "Thus $\\cos 30^\\circ = \\boxed{\\frac{\\sqrt{2}}{2}}$.",  # MATH, wrong
        "The point is $\\boxed{(3,-1)}$.",
    ]
    answers = ["18", "1080", "18", "\\frac{\\sqrt{3}}{2}", "(3,-1)"]
    assert math_answer(["p"] * 5, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]


LONG_RATIO = "1" * 600 + "/" + "7" * 600  # past MAX_NUMBER: compared as text
WORST_CASES = [  # (completion, the answer extracted from it)
    ("\\boxed{1e999999999}", "1e999999999"),
    ("\\boxed{9^{9^{9^{9}}}}", "9^{9^{9^{9}}}"),  # SymPy would evaluate the tower
    ("\\boxed{(10^{100})!}", "(10^{100})!"),
    ("\\boxed{2^{99999999}}", "2^{99999999}"),
    ("\\boxed{" + "x^{" * 50 + "2" + "}" * 50 + "}", "x^{" * 50 + "2" + "}" * 50),
    ("\\boxed{" + "\\frac{" * 100 + "1" + "}{2}" * 100 + "}", "\\frac{" * 100 + "1" + "}{2}" * 100),
    ("\\boxed{" + "{" * 300 + "1" + "}" * 300 + "}", "{" * 300 + "1" + "}" * 300),  # short enough to parse
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


@pytest.mark.slow
@pytest.mark.timeout(300, method="thread")
def test_worst_cases_get_a_verdict_in_the_reward_sandbox_and_spare_their_batch():
    """The built-in as the rollout server runs it: in the sandboxed worker under the job's timeout.
    Every pathological answer scores 0 (by the reward's own bound or, at worst, the sandbox's),
    and when the reward's bound held, the right answer in the same batch still scores 1."""
    scorer = RewardScorer(RewardSpec(functions=[{"builtin": "math"}], timeout_seconds=120))
    try:
        completions = ["\\boxed{\\frac{\\sqrt{3}}{2}}", *(c for c, _ in WORST_CASES)]
        answers = ["\\sqrt{3}/2"] + ["2"] * len(WORST_CASES)
        scored = scorer.score(["p"] * len(completions), completions, {"answer": answers})
    finally:
        scorer.close()
    rewards = [reward for reward, _ in scored]
    assert rewards[1:] == [0.0] * len(WORST_CASES)
    errors = {detail.error for _, details in scored for detail in details}
    if errors == {None}:  # the reward bounded itself: nothing was zeroed wholesale
        assert rewards[0] == 1.0
