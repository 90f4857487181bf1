"""Built-in `math`: the completion's final answer compared to the `answer` column, as mathematics.

The final answer is the last `\\boxed{...}`, else what follows the last `####` (GSM8K) or `answer
is`, else the last number in the text. Plain numbers compare exactly as fractions (so 0.5, 1/2 and
\\frac{1}{2} agree; 1,000 equals 1000). Anything else goes to Hugging Face's `math-verify`, which
parses LaTeX (and plain expressions) into SymPy and compares values, sets, intervals and equations
(so `\\frac{\\sqrt{3}}{2}` equals `\\sqrt{3}/2` and `2^{10}` equals 1024); answers it cannot read
compare as normalised text.

The model writes what is parsed here, so no answer may make scoring slow or large: only the last
MAX_TEXT characters of a completion are read and every scan is linear; a number is built only
when it has at most MAX_NUMBER characters and an exponent within ±MAX_EXPONENT (`1e999999999`
would otherwise expand to a billion-digit integer); an answer longer than MAX_SYMBOLIC characters
is never handed to SymPy, nor is one holding a number past the exponent bound (SymPy would build
it in C, where no timer reaches); and each SymPy comparison (parse and verify of one answer) gets
ANSWER_SECONDS of CPU time. A comparison still unfinished then is no verdict: the completion scores
`Unjudged` (0, reported as a reward timeout), never silently wrong. The bound is CPU time
(ITIMER_PROF, SIGPROF), not wall time: time the worker waits for a CPU on a busy machine does not
count, so load never changes a verdict, while a hostile answer, which burns CPU, is still stopped.
It holds where the reward normally runs, the main thread of the reward worker; elsewhere (a reward
called from a thread) the worker's `reward.timeoutSeconds` is the only bound, as for any reward.

math-verify and SymPy are imported and warmed (`warm_up`: a few comparisons, so the parser and
SymPy's lazy internals are built; about 2 s of CPU, once) when a worker loads `math`, and elsewhere
before the first symbolic comparison, outside any timer: a cold first comparison alone can take a
second of CPU. The registry imports every built-in when a worker loads any reward, so the import is lazy.
"""

import functools
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

from grpo_rollout.rewards.base import BUILTINS, Unjudged, require_column, warmed_by

MAX_TEXT = 100_000  # characters read from the end of a completion
MAX_NUMBER = 1000  # characters of one number, fraction parts included
MAX_EXPONENT = 1000  # |e| in 1.5e-3; 10**1000 is still a cheap integer
MAX_SYMBOLIC = 1000  # characters of an answer SymPy may parse; real final answers are far shorter
ANSWER_SECONDS = 1.0  # SymPy's CPU time for one answer: warm, real answers take 0.01-0.4 s; 9 hostile
# ones fit the default 10 s reward.timeoutSeconds on an idle core

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
MARKERS = re.compile(r"(?:####|answer is:?)\s*(.+)", re.IGNORECASE)
BRACES = re.compile(r"[{}]")
DECIMAL = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?(?:e([+-]?\d+))?", re.IGNORECASE)
RATIO = re.compile(r"([+-]?\d+)/(\d+)")
FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
EXPONENTS = re.compile(r"\d[eE][+-]?(\d+)")  # `1E+999999999`: SymPy's Float would build it in C, unstoppably


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces (one pass over the braces, any depth)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for brace in BRACES.finditer(text, i):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[i : brace.start()]
    return None


def extract_answer(text: str) -> str | None:
    text = text[-MAX_TEXT:]
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    markers = MARKERS.findall(text)
    if markers:
        return markers[-1].strip().rstrip(".")
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def decimal(s: str) -> Fraction | None:
    """An integer or decimal with an optional exponent (`-12`, `.5`, `1.5e3`), within the bounds."""
    m = DECIMAL.fullmatch(s) if len(s) <= MAX_NUMBER else None
    if m is None:
        return None
    sign, whole, fraction, exponent = m.group(1), m.group(2), m.group(3) or "", m.group(4) or "0"
    shift = int(exponent)  # at most MAX_NUMBER digits: cheap; it is the power of ten that is not
    if not (whole or fraction) or abs(shift) > MAX_EXPONENT:
        return None
    value = Fraction(int(whole + fraction), 10 ** len(fraction)) * Fraction(10) ** shift
    return -value if sign == "-" else value


def to_number(text: str) -> Fraction | None:
    """The exact value of a number, `a/b` or `\\frac{a}{b}`; None for anything else or past the bounds."""
    s = text.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    if len(s) > MAX_NUMBER:
        return None
    parts = FRAC.fullmatch(s) or RATIO.fullmatch(s)
    if parts is None:
        return decimal(s)
    numerator, denominator = decimal(parts.group(1)), decimal(parts.group(2))
    if numerator is None or not denominator:  # not a number, or a zero denominator
        return None
    return numerator / denominator


class AnswerTimeout(BaseException):
    """ANSWER_SECONDS passed. A BaseException, so math-verify's own `except Exception` lets it out."""


@contextmanager
def cpu_limit(seconds: float) -> Iterator[None]:
    """Raise AnswerTimeout in the block once this process has spent `seconds` of CPU time in it.

    Main thread only (elsewhere no limit). Time spent waiting for a CPU, or asleep, is not counted.
    Wall-clock timers (pytest-timeout's SIGALRM) run on untouched; a CPU-time timer already running
    (ITIMER_PROF: a profiler's) is paused meanwhile and re-armed after, less the CPU the block took.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    done = False

    def expire(signum: int, frame: Any) -> None:
        if not done:  # a signal landing during the clean-up below is too late to count
            raise AnswerTimeout

    previous = signal.signal(signal.SIGPROF, expire)
    outer, interval = signal.setitimer(signal.ITIMER_PROF, seconds)
    start = time.process_time()
    try:
        yield
    finally:
        done = True
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
        if outer > 0:
            left = max(outer - (time.process_time() - start), 1e-3)
            signal.setitimer(signal.ITIMER_PROF, left, interval)


@functools.cache
def _math_verify() -> tuple[Any, Any, tuple[Any, ...], tuple[Any, ...]]:
    """math-verify's parse and verify, and how answers are read: LaTeX, else a plain expression."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # LaTeX: a \boxed{...} answer or a dataset's gold answer; an expression (`sqrt(3)/2`, `1/2`):
    # what follows a `####` or `answer is`
    return parse, verify, (LatexExtractionConfig(),), (ExprExtractionConfig(),)


def _sympy(answer: str) -> list[Any]:
    """math-verify's reading of one answer: as LaTeX, else as a plain expression ([] if neither)."""
    parse, _, latex, expression = _math_verify()
    as_latex = parse(f"${answer}$", latex, parsing_timeout=None)
    return as_latex or parse(answer, expression, parsing_timeout=None)


def same_symbolically(predicted: str, expected: str, seconds: float = ANSWER_SECONDS) -> bool:
    """math-verify's verdict within MAX_SYMBOLIC (False past it); AnswerTimeout past `seconds` of CPU."""
    if max(len(predicted), len(expected)) > MAX_SYMBOLIC:
        return False
    if any(len(e) > 4 or int(e) > MAX_EXPONENT for e in EXPONENTS.findall(predicted + " " + expected)):
        return False
    warm_up()  # once per process, and not on the answer's time
    try:
        with cpu_limit(seconds):
            return _compare(predicted, expected)
    except RecursionError:
        return False


def _compare(predicted: str, expected: str) -> bool:
    verify = _math_verify()[1]
    gold, guess = _sympy(expected), _sympy(predicted)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=None))


def same_answer(predicted: str, expected: str, seconds: float = ANSWER_SECONDS) -> bool:
    """Exact for two plain numbers; else equal as normalised text, else equal to math-verify.
    AnswerTimeout when math-verify needs more than `seconds` of CPU."""
    a, b = to_number(predicted), to_number(expected)
    if a is not None and b is not None:
        return a == b
    norm = lambda s: re.sub(r"\s+", "", s).strip("$.").lower()  # noqa: E731
    return norm(predicted) == norm(expected) or same_symbolically(predicted, expected, seconds)


WARM_UP_PAIRS = [  # one of each path a first answer would otherwise pay for: LaTeX, sets, polynomials
    ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"),
    ("(x+1)^2", "x^2+2x+1"),
    ("2\\pi", "\\pi \\cdot 2"),
    ("\\{1,2\\}", "(1, 2]"),
    ("\\frac{x^2-1}{x-1}", "x+1"),
    ("sqrt(8)", "2*sqrt(2)"),
]


@functools.cache
def warm_up() -> None:
    """Import math-verify and build SymPy's lazy parts, once: the worker runs this when it loads `math`,
    and the first symbolic comparison in any other process before its timer starts."""
    for predicted, expected in WARM_UP_PAIRS:
        _compare(predicted, expected)


def judge(completion: str, answer: Any, seconds: float = ANSWER_SECONDS) -> float:
    """1.0 or 0.0; Unjudged when math-verify ran out of its CPU time."""
    predicted = extract_answer(completion)
    if predicted is None or answer is None:
        return 0.0
    try:
        return float(same_answer(predicted, str(answer), seconds))
    except AnswerTimeout:
        return Unjudged(f"math: comparing the answer took over {seconds:g}s of CPU time (ANSWER_SECONDS)")


@BUILTINS.register("math")
@warmed_by(warm_up)
def math_answer(prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
    answers = require_column(columns, "answer", "math")
    return [judge(completion, answer) for completion, answer in zip(completions, answers, strict=True)]
