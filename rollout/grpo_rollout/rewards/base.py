"""The reward-function interface and the registry of built-ins, used by the scorer and its worker.

A reward function has TRL's batch signature: fn(prompts, completions, **columns) -> list[float],
one score per completion, where each column is a list aligned with the completions. A score of
None means "not applicable" and counts as 0. Built-ins register in `BUILTINS` from their modules in
`grpo_rollout.rewards.builtin`; anything else is a "module:function" path. Both are loaded only in
the sandbox worker that runs them, so the server imports no reward code.
"""

from collections.abc import Callable
from typing import Any

from grpo_wire.registry import Registry

RewardFn = Callable[..., Any]

BUILTINS: Registry[RewardFn] = Registry("reward function", home="grpo_rollout.rewards.builtin")


def load_function(path: str) -> RewardFn:
    """A built-in's name or 'module:function', imported now; a ValueError naming the path otherwise."""
    return BUILTINS.load(path)


def require_column(columns: dict[str, list[Any]], name: str, reward: str) -> list[Any]:
    """A built-in's required dataset column, or a KeyError that names the reward and the column."""
    if name not in columns:
        raise KeyError(f"{reward} needs the dataset column {name!r}; columns present: {sorted(columns)}")
    return columns[name]
