"""Built-in `math`: the completion's final answer compared to the `answer` column, as numbers if possible.

The final answer is the last `\\boxed{...}`, else what follows the last `####` or `answer is`, else
the last number in the text. Numbers compare exactly as fractions (so 0.5, 1/2 and \\frac{1}{2}
agree; 1,000 equals 1000); anything else compares as normalised text.
"""

import re
from fractions import Fraction
from typing import Any

from grpo_rollout.rewards.base import require_column

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
MARKERS = re.compile(r"(?:####|answer is:?)\s*(.+)", re.IGNORECASE)
FRAC = re.compile(r"^\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    markers = MARKERS.findall(text)
    if markers:
        return markers[-1].strip().rstrip(".")
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def to_number(text: str) -> Fraction | None:
    s = text.strip().strip("$").replace(",", "").replace(" ", "").rstrip(".")
    frac = FRAC.match(s)
    try:
        if frac:
            return Fraction(frac.group(1)) / Fraction(frac.group(2))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


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
