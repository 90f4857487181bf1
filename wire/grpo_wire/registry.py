"""The one registry style of every extension point: losses, advantages, EP backends, engines, rewards, tools.

A registry is a named table of built-ins. Each built-in registers itself where it is defined:

    POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", home="grpo_trainer.losses")

    @POLICY_LOSSES.register("grpo")
    def clipped_token_loss(...): ...

`home` is the module or package that holds the built-ins. It is imported at the first lookup, every
module of a package included, so a new built-in is one new file in that package and nothing else of
ours names it; nothing is imported before a name is looked up (the sandbox worker imports only what
a request names the kind of). Where users may also name their own code ('module:function': rewards,
tools, environments) `load` resolves both, with the same errors. The API enum that offers a
registry's names is pinned to it by `tests/unit/test_mirrors.py`.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Built-ins of one kind by name, registered by decorator where each is defined."""

    def __init__(self, kind: str, home: str | None = None) -> None:
        self.kind = kind
        """What an entry is, in errors ("EP backend", "reward function")."""
        self.home = home
        """The module or package whose import registers the built-ins (None: only user paths)."""
        self._entries: dict[str, T] = {}
        self._loaded = home is None
        self._lock = threading.RLock()

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the decorated object the built-in `name` (a second, different one is an error)."""

        def deco(obj: T) -> T:
            known = self._entries.get(name)
            if known is not None and known is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice: {known!r} and {obj!r}")
            self._entries[name] = obj
            return obj

        return deco

    def remove(self, name: str) -> None:
        """Forget `name` (a test's own entry, once the test is done)."""
        self._entries.pop(name, None)

    def _load(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._loaded = True  # first: a home module may look names up while it imports
            assert self.home is not None
            home = importlib.import_module(self.home)
            for module in pkgutil.iter_modules(getattr(home, "__path__", [])):
                if not module.name.startswith("_"):
                    importlib.import_module(f"{self.home}.{module.name}")

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def get(self, name: str) -> T:
        """The built-in `name`, or a ValueError naming the kind and every choice."""
        self._load()
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self.names()}")
        return self._entries[name]

    __getitem__ = get

    def items(self) -> list[tuple[str, T]]:
        return [(name, self._entries[name]) for name in self.names()]

    def load(self, path: str) -> Any:
        """A built-in's name, or 'module:attribute' imported now; a ValueError naming the kind and path."""
        module_name, sep, attr = path.partition(":")
        if not sep and path in self:  # a built-in (their names have no ':': user code imports no home)
            return self._entries[path]
        if not sep or not module_name or not attr:
            raise ValueError(
                f"{self.kind} {path!r} is neither a built-in {self.names()} nor 'module:function'"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"{self.kind} {path!r}: cannot import module {module_name!r}: {e}") from e
        obj = getattr(module, attr, None)
        if not callable(obj):
            raise ValueError(f"{self.kind} {path!r}: module {module_name!r} has no callable {attr!r}")
        return obj

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, home={self.home!r})"
