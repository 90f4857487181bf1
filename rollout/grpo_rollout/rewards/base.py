"""The reward-function interface and the registry of built-ins, used by the scorer and its worker.

A reward function has TRL's batch signature: fn(prompts, completions, **columns) -> list[float],
one score per completion, where each column is a list aligned with the completions. A score of
None means "not applicable" and counts as 0. A score of `Unjudged(reason)` means "no verdict": the
function ran out of its own time (or another budget) for that completion; it counts as 0 too, but
the sample's reward detail says `timed_out` and the reason, and the rollout server counts it as a
reward timeout, so a judgement cut short is never silently a wrong answer.

A function may carry a warm-up (`warmed_by`): the worker calls it once when it loads the function,
at server start and after every restart, outside any timer, so imports and lazy caches are not paid
on a completion's time. Built-ins register in `BUILTINS` from their modules in
`grpo_rollout.rewards.builtin`; anything else is a "module:function" path. Both are loaded only in
the sandbox worker that runs them, so the server imports no reward code.
"""

from collections.abc import Callable
from typing import Any

from grpo_wire.registry import Registry

RewardFn = Callable[..., Any]

BUILTINS: Registry[RewardFn] = Registry("reward function", home="grpo_rollout.rewards.builtin")

WARM_UP = "grpo_warm_up"  # the attribute `warmed_by` sets on a reward function


class Unjudged(float):
    """A score that is no verdict: 0.0 to arithmetic, with the reason the judgement could not finish.

    Return it in a reward function's list for a completion it ran out of time on:
    `Unjudged("SymPy took over 1 s of CPU")`. Anything that adds scores sees 0.0.
    """

    __slots__ = ("reason",)

    def __new__(cls, reason: str) -> "Unjudged":
        self = super().__new__(cls, 0.0)
        self.reason = str(reason)
        return self

    def __repr__(self) -> str:
        return f"Unjudged({self.reason!r})"

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return Unjudged, (self.reason,)


def warmed_by(warm_up: Callable[[], object]) -> Callable[[RewardFn], RewardFn]:
    """Decorator: the worker calls `warm_up()` once when it loads the decorated reward function."""

    def deco(fn: RewardFn) -> RewardFn:
        setattr(fn, WARM_UP, warm_up)
        return fn

    return deco


def load_function(path: str) -> RewardFn:
    """A built-in's name or 'module:function', imported now; a ValueError naming the path otherwise."""
    return BUILTINS.load(path)


def warm_up(fn: RewardFn) -> None:
    """Run the function's warm-up, if it has one (`warmed_by`)."""
    hook = getattr(fn, WARM_UP, None)
    if callable(hook):
        hook()


def require_column(columns: dict[str, list[Any]], name: str, reward: str) -> list[Any]:
    """A built-in's required dataset column, or a KeyError that names the reward and the column."""
    if name not in columns:
        raise KeyError(f"{reward} needs the dataset column {name!r}; columns present: {sorted(columns)}")
    return columns[name]
