"""The `calculator` built-in tool: arithmetic on numbers, evaluated from the syntax tree, never by eval.

Only + - * / // % ** (binary and unary), parentheses, integers and decimals are read. Each step's size
is checked before Python computes it, so `9**9**9` is refused at once instead of taking the worker's
memory and time.
"""

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from grpo_rollout.tools.registry import BUILTINS

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096  # about 1,233 decimal digits: far past any answer, cheap to compute with
# Operators nested inside one another: a bound of its own, not the interpreter's recursion limit
# (which the process may have raised), so the answer never depends on where the tool runs.
MAX_DEPTH = 100

BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
ALLOWED = "numbers, + - * / // % ** and parentheses"


@BUILTINS.register("calculator")
def calculator(expression: str) -> int | float:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression, e.g. "(3 + 4) * 2 ** 10 / 7": numbers, + - * / // % ** and parentheses.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ValueError(
            f"not an arithmetic expression ({e.msg if isinstance(e, SyntaxError) else e})"
        ) from None
    except RecursionError:
        raise ValueError("expression nested too deeply") from None
    try:
        return _checked(_evaluate(tree.body, 0))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("result too large") from None
    except RecursionError:
        raise ValueError("expression nested too deeply") from None


def _evaluate(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise ValueError(f"expression nested too deeply (more than {MAX_DEPTH} levels)")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(BINARY[type(node.op)](left, right))
    found = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
    raise ValueError(f"only {ALLOWED} are allowed; found {found[:40]!r}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse an integer power whose result would pass MAX_INT_BITS, before computing it."""
    ints = isinstance(base, int) and isinstance(exponent, int)
    if ints and exponent > 0 and abs(base) > 1 and exponent * math.log2(abs(base)) > MAX_INT_BITS:
        raise ValueError(f"result too large: {base} ** {exponent} has more than {MAX_INT_BITS} bits")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result too large (not a finite number)")
    return value
