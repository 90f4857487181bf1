"""Which wheels of the GPU wheelhouse serve the Python that runs `run_all.py`, and the project's floor.

`wheelhouse.sh` downloads, for every Python it serves, the wheels of its list at the lock's versions
into one folder: pure wheels (py3-none-any) and abi3 ones once, CPython-specific ones (numpy,
pydantic_core, pyyaml, regex) once per Python. `run_all.py` unpacks only the ones this interpreter
can load, chosen here by the file names' tags (PEP 427: name-version[-build]-python-abi-platform),
and names the distributions that have none. Standard library only: this runs before anything is
unpacked, on whatever Python the lent machine has, also one below the project's floor (which it
then reports from pyproject.toml's requires-python, the one place that floor is written).
"""

from __future__ import annotations

import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_floor(pyproject: Path = ROOT / "pyproject.toml") -> tuple[int, int]:
    """(major, minor) of pyproject.toml's `requires-python = ">=X.Y"` (no tomllib: 3.11+)."""
    found = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)', pyproject.read_text(), re.M)
    if not found:
        raise ValueError(f"{pyproject} has no requires-python >=X.Y")
    return int(found.group(1)), int(found.group(2))


def floor_problem(version: tuple[int, int], floor: tuple[int, int]) -> str | None:
    """Why `version` cannot run the project's code, or None (pure)."""
    if version >= floor:
        return None
    return (
        f"needs Python >= {floor[0]}.{floor[1]} (pyproject.toml requires-python; the lock's transformers, "
        f"numpy and httpx2 too), this is {version[0]}.{version[1]}"
    )


def tags(filename: str) -> tuple[str, list[str], str, str]:
    """(canonical distribution name, python tags, abi tag, platform tag) of a wheel file name."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) not in (5, 6):
        raise ValueError(f"not a wheel file name: {filename}")
    name, python, abi, plat = parts[0], parts[-3], parts[-2], parts[-1]
    return re.sub(r"[-_.]+", "-", name).lower(), python.split("."), abi, plat


def loads_on(filename: str, version: tuple[int, int], machine: str = "x86_64") -> bool:
    """Whether CPython `version` on Linux `machine` can load this wheel (pure)."""
    _, pythons, abi, plat = tags(filename)
    if plat != "any" and not plat.endswith(machine):
        return False
    cp = f"cp{version[0]}{version[1]}"
    for python in pythons:
        if abi == "none" and python in ("py3", f"py{version[0]}{version[1]}", cp):
            return True
        if abi == cp and python == cp:
            return True
        if abi == "abi3" and python.startswith("cp3") and (3, int(python[3:])) <= version:
            return True
    return False


def select(
    filenames: list[str], version: tuple[int, int], machine: str = "x86_64"
) -> tuple[list[str], list[str]]:
    """(the wheels to unpack for `version`, the distributions with no wheel for it) (pure).
    Two loadable wheels of one distribution is an error: unpacked together, one overwrites the other."""
    chosen: dict[str, str] = {}
    names = sorted({tags(f)[0] for f in filenames})
    for f in sorted(filenames):
        if loads_on(f, version, machine):
            name = tags(f)[0]
            if name in chosen:
                raise ValueError(f"two wheels of {name} load on Python {version}: {chosen[name]}, {f}")
            chosen[name] = f
    return sorted(chosen.values()), [n for n in names if n not in chosen]


def this_python() -> tuple[int, int]:
    return sys.version_info[0], sys.version_info[1]


def this_machine() -> str:
    return platform.machine()
