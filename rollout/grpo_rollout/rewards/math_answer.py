"""Built-in `math`: the completion's final answer compared to the `answer` column, as numbers if possible.

The final answer is the last `\\boxed{...}`, else what follows the last `####` or `answer is`, else
the last number in the text. Numbers compare exactly as fractions (so 0.5, 1/2 and \\frac{1}{2}
agree; 1,000 equals 1000); anything else compares as normalised text.

The model writes what is parsed here, so no answer may make parsing slow or large: only the last
MAX_TEXT characters of a completion are read, every scan is linear, nothing is evaluated
(`10**10**10` and `2^{100}` are text), and a number is built only when it has at most MAX_NUMBER
characters and an exponent within ±MAX_EXPONENT (`1e999999999` would otherwise expand to a
billion-digit integer). Past those bounds an answer compares as text, which is still exact.
"""

import re
from fractions import Fraction
from typing import Any

from grpo_rollout.rewards.base import require_column

MAX_TEXT = 100_000  # characters read from the end of a completion
MAX_NUMBER = 1000  # characters of one number, fraction parts included
MAX_EXPONENT = 1000  # |e| in 1.5e-3; 10**1000 is still a cheap integer

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
MARKERS = re.compile(r"(?:####|answer is:?)\s*(.+)", re.IGNORECASE)
BRACES = re.compile(r"[{}]")
DECIMAL = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?(?:e([+-]?\d+))?", re.IGNORECASE)
RATIO = re.compile(r"([+-]?\d+)/(\d+)")
FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


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


def same_answer(predicted: str, expected: str) -> bool:
    a, b = to_number(predicted), to_number(expected)
    if a is not None and b is not None:
        return a == b
    norm = lambda s: re.sub(r"\s+", "", s).strip("$.").lower()  # noqa: E731
    return norm(predicted) == norm(expected)


def math_answer(prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
    answers = require_column(columns, "answer", "math")
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
        predicted = extract_answer(completion)
        scores.append(
            float(predicted is not None and answer is not None and same_answer(predicted, str(answer)))
        )
    return scores
