"""Built-in `countdown`: an arithmetic expression over the `numbers` column that reaches `target`.

As in TinyZero's Countdown task: the expression is the last `<answer>...</answer>` if present, else
the last line (a trailing `= result` is ignored); it may use + - * / and parentheses and must use
every given number exactly once. Score 1 when it evaluates to the target, 0.1 when it is a
well-formed expression over the right numbers that misses, else 0. Only an expression of at most
MAX_EXPRESSION characters that uses exactly the given numbers is evaluated, so its value stays small.
"""

import ast
import operator
import re
from typing import Any

from grpo_rollout.rewards.base import BUILTINS, require_column

FORMAT_SCORE = 0.1
MAX_EXPRESSION = 1000  # characters; a countdown answer combines a handful of small numbers
ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def last_tagged(completion: str) -> str | None:
    """Text of the last <answer>...</answer>, found from the end (a regex rescans per opening tag)."""
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end >= 0 else -1
    return completion[start + len("<answer>") : end] if start >= 0 else None


def extract_expression(completion: str) -> str | None:
    tagged = last_tagged(completion)
    lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
    text = tagged if tagged is not None else (lines[-1] if lines else "")
    expression = text.split("=")[0].strip()
    ok = expression and len(expression) <= MAX_EXPRESSION and ALLOWED.match(expression)
    return expression if ok else None


def evaluate(expression: str) -> float | None:
    """Value of a + - * / expression over integer literals, or None if malformed or dividing by zero."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError(f"not allowed: {ast.dump(node)[:40]}")

    try:
        return float(walk(ast.parse(expression, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def score_one(completion: str, numbers: list[int], target: float) -> float:
    expression = extract_expression(completion)
    if expression is None:
        return 0.0
    used = sorted(int(x) for x in re.findall(r"\d+", expression))
    if used != sorted(int(x) for x in numbers):
        return 0.0
    value = evaluate(expression)
    if value is None:
        return 0.0
    return 1.0 if abs(value - float(target)) < 1e-6 else FORMAT_SCORE


@BUILTINS.register("countdown")
def countdown(prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
    numbers = require_column(columns, "numbers", "countdown")
    targets = require_column(columns, "target", "countdown")
    return [score_one(c, n, t) for c, n, t in zip(completions, numbers, targets, strict=True)]
