"""The reward-function interface and the registry of built-ins, used by the scorer and its worker.

A reward function has TRL's batch signature: fn(prompts, completions, **columns) -> list[float],
one score per completion, where each column is a list aligned with the completions. A score of
None means "not applicable" and counts as 0. Built-ins are named here; anything else is a
"module:function" path imported on the worker that runs plugins.
"""

from collections.abc import Callable
from typing import Any

from grpo_rollout import plugins

BUILTINS: dict[str, str] = {
    "exact_match": "grpo_rollout.rewards.exact_match:exact_match",
    "math": "grpo_rollout.rewards.math_answer:math_answer",
    "countdown": "grpo_rollout.rewards.countdown:countdown",
    "format": "grpo_rollout.rewards.format:think_answer_format",
}


def load_function(path: str) -> Callable[..., Any]:
    """Import 'module:function' (or a built-in's name) and return the callable, with a clear error."""
    return plugins.load_callable(path, BUILTINS, "reward function")


def require_column(columns: dict[str, list[Any]], name: str, reward: str) -> list[Any]:
    """A built-in's required dataset column, or a KeyError that names the reward and the column."""
    if name not in columns:
        raise KeyError(f"{reward} needs the dataset column {name!r}; columns present: {sorted(columns)}")
    return columns[name]
