"""Which tools a job can name: built-ins by name, anything else as 'module:function', loaded in the sandbox.

Built-ins register in `BUILTINS` from their modules in `grpo_rollout.tools.builtin`.
`grpo_rollout.tools.runner.ToolRunner` names the tools; the sandbox worker (`grpo_rollout.rewards.child`)
loads them through `load_tool` and calls them inside `deadline`, so a tool that starts work of its own
(the `python` built-in) can stop before the worker is killed.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from grpo_wire.registry import Registry

ToolFn = Callable[..., Any]

BUILTINS: Registry[ToolFn] = Registry("tool", home="grpo_rollout.tools.builtin")

_deadline: ContextVar[float | None] = ContextVar("tool_deadline", default=None)


def load_tool(path: str) -> ToolFn:
    """A built-in's name or 'module:function', imported now; a ValueError naming the path otherwise."""
    return BUILTINS.load(path)


def tool_name(path: str) -> str:
    """The name the model calls a tool by: a built-in's name, or the function's in 'module:function'.

    Read off the path, not looked up: the server names tools without importing any."""
    return path.rpartition(":")[2]


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Set the time the current call has (the worker's timeout) for `time_left` to read."""
    token = _deadline.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _deadline.reset(token)


def time_left() -> float | None:
    """Seconds before the worker running this call is killed; None outside a timed call."""
    end = _deadline.get()
    return None if end is None else end - time.monotonic()
