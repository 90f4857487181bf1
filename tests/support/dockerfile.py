"""The repository's Dockerfile read as data: stages, build arguments and the pip installs of a target.

No Docker engine runs in the tests, so the static image checks (tests/unit/test_dockerfile.py) and the
resolver check (tests/integration/test_image_resolve.py) read what the image does from here, with the
Dockerfile's own ARG defaults substituted, rather than from a copy of its pins.
"""

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, keyword: str) -> list[str]:
        return [v for k, v in self.instructions if k == keyword]


def parse(text: str) -> dict[str, Stage]:
    """Stages by name, with their instructions (continuations joined, comments dropped)."""
    logical, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            logical.append(buf.strip())
            buf = ""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", rest.strip(), re.IGNORECASE)
            assert m, f"every stage is named: {line}"
            current = stages[m.group(2)] = Stage(m.group(2), m.group(1))
        elif current is not None:
            current.instructions.append((keyword, rest.strip()))
    return stages


def global_args(text: str) -> dict[str, str]:
    """The ARGs before the first FROM: the only ones a FROM line can use, and the defaults a
    stage's bare `ARG NAME` takes."""
    args: dict[str, str] = {}
    for line in text.splitlines():
        if line.upper().startswith("FROM "):
            break
        if line.upper().startswith("ARG "):
            key, _, default = line[4:].strip().partition("=")
            args[key] = default
    return args


STAGES = parse(DOCKERFILE.read_text())
GLOBAL_ARGS = global_args(DOCKERFILE.read_text())

# What each Ubuntu release of the CUDA base ships: its python3, which the GPU images' venv runs,
# and its glibc, the newest manylinux tag pip installs there.
UBUNTU_PYTHON = {"ubuntu22.04": "3.10", "ubuntu24.04": "3.12"}
UBUNTU_GLIBC = {"ubuntu22.04": (2, 35), "ubuntu24.04": (2, 39)}


def cuda_base_ubuntu() -> str:
    """The Ubuntu release of the CUDA base image (`nvidia/cuda:<version>-<flavour>-ubuntuXX.YY@…`)."""
    tag = GLOBAL_ARGS["CUDA_BASE"].split("@")[0].rpartition(":")[2]
    return tag.rsplit("-", 1)[-1]


def chain(name: str) -> list[Stage]:
    """The stage and the stages it builds FROM, nearest first."""
    out = []
    while name in STAGES:
        out.append(STAGES[name])
        name = STAGES[name].base
    return out


def all_runs(name: str) -> str:
    return "\n".join(r for stage in chain(name) for r in stage.values("RUN"))


def build_args(name: str) -> dict[str, str]:
    """The ARGs a stage's RUNs see, with their defaults: a bare `ARG NAME` takes the global default,
    as Docker does."""
    args: dict[str, str] = {}
    for stage in reversed(chain(name)):
        for value in stage.values("ARG"):
            key, eq, default = value.partition("=")
            if eq:
                args[key] = default
            elif key in GLOBAL_ARGS:
                args[key] = GLOBAL_ARGS[key]
    return args


def substitute(text: str, args: dict[str, str]) -> str:
    """`${NAME}` replaced by the build argument; an unknown name is an error, not an empty string."""

    def value(m: re.Match[str]) -> str:
        if m.group(1) not in args:
            raise KeyError(f"Dockerfile uses ${{{m.group(1)}}}, which no ARG in scope defines")
        return args[m.group(1)]

    return re.sub(r"\$\{(\w+)\}", value, text)


def commands(name: str) -> list[str]:
    """Each `&&`-joined shell command of the stage chain's RUNs, in build order, mounts dropped."""
    out: list[str] = []
    for stage in reversed(chain(name)):
        for run in stage.values("RUN"):
            body = re.sub(r"^(?:--mount=\S+\s+)+", "", run)
            out.extend(part.strip() for part in body.split(" && "))
    return out


@dataclass(frozen=True)
class PipInstall:
    """One `pip install` of an image build: its requirement arguments (ARGs substituted), whether
    it skips dependency resolution (`--no-deps` overrides) and the indexes it reads."""

    requirements: tuple[str, ...]
    no_deps: bool
    index_url: str | None
    extra_index_urls: tuple[str, ...]


def pip_installs(name: str) -> list[PipInstall]:
    """The `pip install` commands a target runs, in order, through the stages it builds FROM."""
    args = build_args(name)
    installs = []
    for command in commands(name):
        words = shlex.split(command)
        if words[:2] != ["pip", "install"]:
            continue
        requirements: list[str] = []
        no_deps, index_url, extra = False, None, []
        rest = iter(words[2:])
        for word in rest:
            if word == "--no-deps":
                no_deps = True
            elif word == "--index-url":
                index_url = substitute(next(rest), args)
            elif word == "--extra-index-url":
                extra.append(substitute(next(rest), args))
            elif word in {"--no-cache-dir", "--upgrade"}:
                continue
            elif word.startswith("-"):
                raise ValueError(f"{name}: pip option {word} is not modelled by tests/support/dockerfile.py")
            else:
                requirements.append(substitute(word, args))
        installs.append(PipInstall(tuple(requirements), no_deps, index_url, tuple(extra)))
    return installs
