"""Built-in math reward (grpo_rollout.rewards.builtin.math_answer): answer extraction, numbers, math-verify.

Answers are written the way real math datasets write them: GSM8K's `#### 72` and MATH's
`\\boxed{...}` LaTeX, with equivalent and non-equivalent forms of the same gold answer.
The worst cases are answers a model can write that once took hours (`1e999999999` expanded to a
billion-digit integer, towers of exponents SymPy would evaluate); each must come back with a
verdict. Their pytest timeout is a generous does-not-hang bound, enforced from a thread because a
stuck big-integer operation never returns to the interpreter for a signal to land; the batch of
them also goes through the real reward sandbox, where the job's reward timeout is the last word.
SymPy's bound is CPU time, so load beside the reward changes no verdict: the timer itself is tested
(a busy loop is stopped, a sleep is not), and the issue-46 pairs are scored in a real reward worker
with every core spinning beside it. An answer that runs out of the bound is `Unjudged`, not wrong.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from grpo_operator.api.spec import RewardSpec
from grpo_rollout.rewards.base import Unjudged
from grpo_rollout.rewards.builtin.math_answer import (
    MAX_TEXT,
    AnswerTimeout,
    cpu_limit,
    extract_answer,
    judge,
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
    details = [detail for _, (detail,) in scored]
    assert all(d.timed_out for d in details if d.error is not None)  # no verdict, never a silent 0
    if not any("timed out after" in (d.error or "") for d in details):  # the reward bounded itself
        assert rewards[0] == 1.0 and details[0].error is None


@pytest.mark.timeout(30, method="signal")  # pytest-timeout's wall-clock SIGALRM timer runs beside it
def test_the_cpu_bound_stops_a_busy_loop_and_leaves_wall_clock_timers_alone():
    alarm, real = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0]
    assert real > 0
    start = time.process_time()
    with pytest.raises(AnswerTimeout), cpu_limit(0.2):
        while True:
            pass
    assert 0.15 < time.process_time() - start < 10
    assert signal.getsignal(signal.SIGALRM) is alarm and 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= real
    assert signal.getitimer(signal.ITIMER_PROF) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGPROF) in (signal.SIG_DFL, None)


def test_the_bound_counts_cpu_time_not_wall_time():
    start = time.monotonic()
    with cpu_limit(0.1):
        time.sleep(0.5)  # five times the bound, but asleep: waiting spends no CPU
    assert time.monotonic() - start >= 0.5


def test_an_outer_cpu_timer_is_paused_and_rearmed_less_the_cpu_spent():
    fired: list[int] = []

    def outer(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGPROF, outer)
    signal.setitimer(signal.ITIMER_PROF, 30.0)
    try:
        with pytest.raises(AnswerTimeout), cpu_limit(0.2):
            while True:
                pass
        left, _ = signal.getitimer(signal.ITIMER_PROF)
        assert 25.0 < left < 29.9 and fired == []
        assert signal.getsignal(signal.SIGPROF) is outer
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def test_an_answer_out_of_cpu_time_is_unjudged_not_wrong():
    score = judge("\\boxed{9^{9^{9^{9}}}}", "2", seconds=0.2)  # SymPy would evaluate the tower
    assert isinstance(score, Unjudged) and score == 0.0
    assert "over 0.2s of CPU time" in score.reason
    assert judge("\\boxed{\\frac{14}{2}}", "7", seconds=0.2) == 1.0
    assert judge("\\boxed{8}", "7", seconds=0.2) == 0.0


def test_loading_another_builtin_imports_no_sympy():
    code = (
        "import sys; from grpo_rollout.rewards import child; child.load({}, 'exact_match'); "
        "assert not {'sympy', 'math_verify'} & set(sys.modules), sorted(sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


HIDDEN_STYLE = [  # (completion, gold answer, the verdict on an idle machine: 1.0, 0.0, None = no verdict)
    ("\\boxed{\\sqrt{3}/2}", "\\frac{\\sqrt{3}}{2}", 1.0),  # the four issue 46 saw scored 0 under load
    ("\\boxed{\\pi \\cdot 2}", "2\\pi", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{(x+2)(x+5)}", "x^2+7x+10", 1.0),
    ("\\boxed{\\sqrt{20}}", "2\\sqrt{5}", 1.0),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),
    ("Half of 2,160 is 1,080.\n#### 1,080", "1080", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{3}}{2}", 0.0),
    ("\\boxed{(-1,3)}", "(3,-1)", 0.0),
    ("\\boxed{(x+2)(x+6)}", "x^2+7x+10", 0.0),
    ("\\boxed{5\\sqrt{2}}", "2\\sqrt{5}", 0.0),
    ("\\boxed{2^{11}}", "1024", 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", "2", None),  # burns CPU far past the bound on any machine
    ("\\boxed{1e999999999}", "2", 0.0),  # the rest are refused by the bounds at once
    ("\\boxed{" + "\\frac{" * 100 + "1" + "}{2}" * 100 + "}", "2", 0.0),
    ("\\boxed{" + "{" * 40_000 + "1" + "}" * 40_001, "2", 0.0),
    ("x" * 1_000_000 + " so the answer is 7", "7", 1.0),
]


@contextmanager
def every_core_busy() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A busy loop per core, beside the block, killed after it whatever happens."""
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(os.cpu_count() or 1):
            spinners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(300, method="thread")
def test_verdicts_in_a_reward_worker_do_not_change_with_every_core_busy():
    """The built-in as the rollout server runs it (a warmed, sandboxed worker) with a busy loop on
    every core beside it: each verdict is the idle one. The job's reward.timeoutSeconds is wall time
    and the sandbox's last word (a batch past it has no verdict either way); it is set high here, so
    that what is tested is the reward's own bound."""
    scorer = RewardScorer(RewardSpec(functions=[{"builtin": "math"}], timeout_seconds=120))
    completions = [completion for completion, _, _ in HIDDEN_STYLE]
    answers = [gold for _, gold, _ in HIDDEN_STYLE]
    try:
        worker = scorer._worker._proc
        assert worker is not None  # started and warmed by the scorer's start-up check
        cpu0 = cpu_seconds(worker.pid)
        with every_core_busy() as spinners:
            t0 = time.monotonic()
            scored = scorer.score(["p"] * len(completions), completions, {"answer": answers})
            wall = time.monotonic() - t0
            assert all(spinner.poll() is None for spinner in spinners)  # they spun all along
        cpu = cpu_seconds(worker.pid) - cpu0
    finally:
        scorer.close()
    verdicts = [None if detail.timed_out else detail.score for _, (detail,) in scored]
    assert verdicts == [verdict for _, _, verdict in HIDDEN_STYLE]
    assert all(detail.error is None for _, (detail,) in scored if not detail.timed_out)
    print(f"{len(completions)} answers: {wall:.1f}s of wall time, {cpu:.1f}s of the worker's CPU")
