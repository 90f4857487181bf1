"""The sandbox side of interactive environments: one worker's live instances, and checks on what they return.

`grpo_rollout.rewards.child` answers the "env_*" requests of `grpo_rollout.environments.EnvironmentRunner`
through `EpisodeHost`. An environment is a user class ('module:Name', spec.environment.class) with
`reset(row) -> messages` and `step(messages) -> {"messages", "done", "reward"?}`. Unlike a tool it is
stateful, so the host keeps one instance per episode between requests, in this process only: the runner
pins each episode to the worker that holds it. Everything user code returns is checked here, before it
is sent, so the server only ever reads well-formed messages, and a broken environment gets an error that
names the method and what was wrong.
"""

import inspect
import math
import numbers
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from grpo_wire.registry import Registry

# No built-ins: every environment is the user's 'module:Name', loaded as rewards and tools are.
CLASSES: Registry[type] = Registry("environment class")
ROLES = ("system", "user", "assistant", "tool")
# Instances alive in one worker at most: a caller that never closes its episodes evicts its own oldest
# ones (their next step is an error) instead of growing the worker to its memory limit.
MAX_LIVE_EPISODES = 4096
MAX_MESSAGES = 64  # per reset or step: what one environment turn adds to the context


class EnvError(Exception):
    """What the environment did wrong, worded for the episode's error result."""


def load_class(path: str) -> type:
    """Import 'module:Name' and check it is a class with callable `reset` and `step`."""
    try:
        cls = CLASSES.load(path)
    except ValueError as e:  # the loader's message names the class and what is missing
        raise EnvError(str(e)) from e
    if not inspect.isclass(cls):
        raise EnvError(f"environment class {path!r} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"environment class {path!r} has no {' or '.join(missing)} method")
    return cls


def check_args(cls: type, args: dict[str, Any], path: str) -> None:
    """Bind `args` to the constructor now, so a wrong spec.environment.args fails at start-up."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a constructor written in C: the first reset will tell
        return
    try:
        signature.bind(**args)
    except TypeError as e:
        raise EnvError(f"wrong args for environment class {path!r}: {e}") from None


class EpisodeHost:
    """The live environment instances of one worker, by episode id, least recently used first."""

    def __init__(self, max_live: int = MAX_LIVE_EPISODES) -> None:
        self.max_live = max_live
        self.live: OrderedDict[str, Any] = OrderedDict()

    def reset(self, cls: type, args: dict[str, Any], episode: str, row: Any, max_chars: int) -> list[dict]:
        if episode in self.live:
            raise EnvError(f"episode {episode!r} is already live")
        env = user_call("the constructor", cls, **args)
        messages = checked_messages(user_call("reset()", env.reset, row), "reset()", max_chars)
        if not messages:
            raise EnvError("reset() returned no messages: the model needs a prompt")
        self.live[episode] = env  # only once reset has succeeded: a failed episode leaves nothing
        while len(self.live) > self.max_live:
            self.live.popitem(last=False)
        return messages

    def step(self, episode: str, messages: list[dict], max_chars: int) -> dict[str, Any]:
        """The step's checked result; the instance is dropped when done or when the step fails."""
        env = self.live.pop(episode, None)
        if env is None:
            raise EnvError(f"no live episode {episode!r} (it ended, was closed, or was evicted)")
        result = checked_step(user_call("step()", env.step, messages), max_chars)
        if not result["done"]:
            self.live[episode] = env  # back in, as the most recently used
        return result

    def close(self, episode: str) -> None:
        self.live.pop(episode, None)


def user_call(method: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(...)`, its exception as an EnvError naming `method`; MemoryError as it is."""
    try:
        return fn(*args, **kwargs)
    except MemoryError:
        raise
    except Exception as e:
        raise EnvError(f"{method} raised {type(e).__name__}: {e}") from e


def checked_step(result: Any, max_chars: int) -> dict[str, Any]:
    if not isinstance(result, Mapping):
        raise EnvError(f"step() returned {type(result).__name__}, not a dict with messages, reward, done")
    unknown = sorted(str(k) for k in result if k not in ("messages", "reward", "done"))
    if unknown:
        raise EnvError(f"step() returned unknown keys {unknown}; it returns messages, reward, done")
    for key in ("messages", "done"):
        if key not in result:
            raise EnvError(f"step() returned no {key!r}")
    done, reward = result["done"], result.get("reward")
    if not isinstance(done, bool):  # strict: "yes" or 1 are bugs, not answers
        raise EnvError(f"step() returned done {done!r}: not True or False")
    if reward is not None:
        if not isinstance(reward, numbers.Real):
            raise EnvError(f"step() returned reward {reward!r}: not a number")
        if not math.isfinite(float(reward)):
            raise EnvError(f"step() returned reward {reward!r}: not finite")
        reward = float(reward)
    messages = checked_messages(result["messages"], "step()", max_chars)
    return {"messages": messages, "reward": reward, "done": done}


def checked_messages(messages: Any, method: str, max_chars: int) -> list[dict[str, str]]:
    """Chat messages of {role, content} each, their contents cut to `max_chars` with a visible marker."""
    if not isinstance(messages, list):
        raise EnvError(f"{method} returned messages of type {type(messages).__name__}, not a list")
    if len(messages) > MAX_MESSAGES:
        raise EnvError(f"{method} returned {len(messages)} messages; at most {MAX_MESSAGES}")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) != {"role", "content"}:
            keys = sorted(map(str, m)) if isinstance(m, Mapping) else type(m).__name__
            raise EnvError(f"{method} returned message {i} as {keys}, not {{'role', 'content'}}")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise EnvError(f"{method} returned message {i} with role {role!r}, not one of {list(ROLES)}")
        if not isinstance(content, str):
            raise EnvError(f"{method} returned message {i} with content of type {type(content).__name__}")
        checked.append({"role": role, "content": cap(content, max_chars)})
    return checked


def cap(text: str, max_chars: int) -> str:
    """As `grpo_rollout.rewards.child.cap` (which imports this module): the model sees the cut."""
    cut = len(text) - max_chars
    return text if cut <= 0 else f"{text[:max_chars]}\n[truncated {cut} chars]"
