"""Importing DeepEP in a process whose NCCL already loaded its network plugin (EFA), keeping DeepEP's
one-NCCL check. Called by `grpo_trainer.moe.deepep` when the DeepEP backends register.

At the pinned commit (Dockerfile DEEPEP_COMMIT dd758caf, `deep_ep/__init__.py` `check_nccl_so`, run
at import unless EP_SUPPRESS_NCCL_CHECK is set), DeepEP asserts that every `/proc/self/maps` entry
whose path contains "libnccl" is one and the same file, and that this file is byte-equal to the
`libnccl.so*` under its `find_nccl_root()/lib`. On EFA, NCCL loads the aws-ofi-nccl plugin
(`libnccl-net*.so`, and its tuner `libnccl-ofi-tuner.so`) when the first communicator is created:
those paths contain "libnccl" too, so every trainer rank that made its NCCL groups before importing
deep_ep failed the check with one NCCL runtime loaded, and DeepEP was never used on EFA.

The check is kept, with plugins told apart from runtimes: a runtime is a file named
`libnccl.so[.N...]`; anything else named libnccl* is a plugin NCCL loaded. Before the import at most
one runtime may be mapped; deep_ep is imported with its own check suppressed (for that import only);
then the runtime is compared byte for byte with the one DeepEP links, as DeepEP does. A second
runtime or a different build refuses DeepEP with both paths named, as DeepEP's assertion did. The
image build proves one NCCL across torch and DeepEP (tests/unit/test_dockerfile.py); this keeps the
running process honest too.
"""

from __future__ import annotations

import filecmp
import glob
import importlib
import os
import re
from pathlib import Path
from typing import Any

RUNTIME = re.compile(r"^libnccl\.so(\.\d+)*$")
SUPPRESS = "EP_SUPPRESS_NCCL_CHECK"


def nccl_files(maps: str) -> tuple[set[str], set[str]]:
    """(runtimes, plugins): the distinct files named libnccl* in a `/proc/<pid>/maps` text (pure)."""
    runtimes: set[str] = set()
    plugins: set[str] = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or "libnccl" not in fields[5]:
            continue
        path = fields[5].removesuffix(" (deleted)")
        (runtimes if RUNTIME.match(os.path.basename(path)) else plugins).add(path)
    return runtimes, plugins


def runtime_problem(runtimes: set[str], linked: list[str]) -> str | None:
    """Why the mapped NCCL runtime(s) do not match the one DeepEP links (`linked`: its
    `find_nccl_root()/lib/libnccl.so*`, sorted), or None."""
    if len(runtimes) > 1:
        return f"two NCCL runtimes are loaded in this process: {', '.join(sorted(runtimes))}"
    if not runtimes:
        return None  # none loaded yet: DeepEP's own library brings the one it links
    if not linked:
        return "DeepEP's NCCL root has no lib/libnccl.so*"
    loaded = next(iter(runtimes))
    if not filecmp.cmp(loaded, linked[0], shallow=False):
        return f"the loaded NCCL runtime {loaded} is not the build DeepEP links ({linked[0]})"
    return None


def mapped_runtimes() -> set[str]:
    return nccl_files(Path("/proc/self/maps").read_text())[0]


def import_deep_ep(attr: str) -> tuple[Any, str]:
    """(`deep_ep.<attr>`, "") or (None, why). DeepEP's import runs checks that raise AssertionError
    (no CUDA, its NCCL check), so any exception means "not usable here", its type and text the why."""
    runtimes: set[str] | None = None  # None: DeepEP's own check runs as it ships
    if os.environ.get(SUPPRESS, "0") in ("", "0"):  # the user did not turn the check off
        try:
            runtimes = mapped_runtimes()
        except OSError:  # no /proc (not Linux)
            runtimes = None
    if runtimes is not None and len(runtimes) > 1:
        return None, f"deep_ep refused: {runtime_problem(runtimes, [])}"
    saved = os.environ.get(SUPPRESS)
    if runtimes is not None:
        os.environ[SUPPRESS] = "1"  # ours above and below, with NCCL's plugins told apart
    try:
        module = importlib.import_module("deep_ep")
    except Exception as e:
        return None, f"deep_ep does not import ({type(e).__name__}: {e})"
    finally:
        if runtimes is not None:
            if saved is None:
                os.environ.pop(SUPPRESS, None)
            else:
                os.environ[SUPPRESS] = saved
    if runtimes is not None:
        problem = runtime_problem(runtimes or mapped_runtimes(), linked_runtimes(module))
        if problem:
            return None, f"deep_ep refused: {problem}"
    if not hasattr(module, attr):
        return None, f"this deep_ep has no {attr} (installed version {getattr(module, '__version__', '?')})"
    return getattr(module, attr), ""


def linked_runtimes(module: Any) -> list[str]:
    """The libnccl.so* files under DeepEP's NCCL root (`deep_ep.utils.find_pkgs.find_nccl_root`)."""
    find_pkgs = importlib.import_module(f"{module.__name__}.utils.find_pkgs")
    return sorted(glob.glob(f"{find_pkgs.find_nccl_root()}/lib/libnccl.so*"))
