"""The one loader for named plugins: a built-in's name or a 'module:function' path, imported on demand.

Rewards (`grpo_rollout.rewards.base`), tools (`grpo_rollout.tools.registry`) and tool-call parsers
(`grpo_rollout.tools.parsers`) keep a registry of built-in names mapped to 'module:attribute' paths and
load through here, so every plugin kind is named, found and reported the same way. Imports stay lazy:
the sandbox worker imports only what a request names.
"""

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def load_callable(path: str, builtins: Mapping[str, str], kind: str) -> Callable[..., Any]:
    """Import 'module:attribute' (or a built-in's name) and return it; a ValueError naming `kind` and path."""
    target = builtins.get(path, path)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{kind} {path!r} is neither a built-in {sorted(builtins)} nor 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{kind} {path!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{kind} {path!r}: module {module_name!r} has no callable {attr!r}")
    return fn
