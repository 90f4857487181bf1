"""The trainer and rollout images' Python packages, resolved by pip as the Dockerfile installs them.

No Docker engine runs here, and an image that cannot resolve, or that ends with two torches, two
NCCLs or two CUDAs between trainer and rollout, fails only at build or at the first weight stream
on a GPU fleet. So each image's `pip install` lines are read from the Dockerfile (tests/support/dockerfile.py,
ARG defaults substituted) and handed to pip's resolver for the images' platform (linux x86_64,
Ubuntu's CPython and glibc), one dry run per image: the resolving installs together, then the
`--no-deps` overrides laid over the result, as pip leaves them in the image. PyPI is reachable here
and in CI; pip's own HTTP cache keeps a second run short.
"""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import all2all_images
from tests.support.dockerfile import (
    GLOBAL_ARGS,
    ROOT,
    UBUNTU_GLIBC,
    UBUNTU_PYTHON,
    build_args,
    cuda_base_ubuntu,
    pip_installs,
)

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # on PyPI: it runs beside the CPU-bound rings

IMAGES = ("trainer", "rollout")
PROJECT = "grpo-operator"
# The project's wheel as the images install it: `"$(ls /wheels/grpo_operator-*.whl)[extras]"`.
PROJECT_WHEEL = re.compile(r"\$\(ls /wheels/grpo_operator-\*\.whl\)\[(?P<extras>[\w,]+)\]")
# Wheels the image builds itself and whose metadata declares no requirements: DeepEP's setup.py
# (at the pinned DEEPEP_COMMIT) passes no install_requires.
BUILT_WITHOUT_REQUIREMENTS = {"/ep-wheels/deep_ep-*.whl"}
# Packages PyPI has as sdists only: the image builds them, and pip's resolver cannot take an sdist
# for a foreign platform, so they are built into wheels here first (pure Python) and found there.
SDIST_ONLY = {"deepspeed"}


def project_requirements(extras: list[str]) -> list[str]:
    """What the project's wheel requires with these extras, read from pyproject: the extras' (in
    pyproject's order) before the base dependencies. pip's resolver is sensitive to the order of
    requested names: in the wheel's own order (base first) pip 26.3 backtracks through
    aiobotocore/botocore releases for more than five minutes on the trainer's set, which has a
    solution at the newest releases; this order resolves in about a minute."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    wanted, todo = set(), list(extras)
    while todo:
        extra = todo.pop()
        if extra not in optional:
            raise KeyError(f"the Dockerfile installs the project with extra [{extra}], which pyproject lacks")
        if extra not in wanted:
            wanted.add(extra)
            todo += [x for r in optional[extra] if _is_self(r) for x in Requirement(r).extras]
    chosen = [r for extra in optional if extra in wanted for r in optional[extra] if not _is_self(r)]
    return [*chosen, *project["dependencies"]]


def _is_self(requirement: str) -> bool:
    return canonicalize_name(Requirement(requirement).name) == PROJECT


def image_requirements(target: str) -> tuple[list[str], dict[str, str], list[str]]:
    """(what the resolving installs ask for, the `--no-deps` pins laid over them, pip index options)."""
    resolving: list[str] = []
    overrides: dict[str, str] = {}
    index_options: list[str] = []
    for install in pip_installs(target):
        if install.index_url:
            index_options += ["--index-url", install.index_url]
        for url in install.extra_index_urls:
            index_options += ["--extra-index-url", url]
        if install.no_deps:
            for req in install.requirements:
                parsed = Requirement(req)
                pins = [s.version for s in parsed.specifier if s.operator == "=="]
                assert len(pins) == 1, f"{target}: a --no-deps install pins one version: {req}"
                overrides[canonicalize_name(parsed.name)] = pins[0]
            continue
        assert not overrides, f"{target}: a resolving pip install after a --no-deps one is not modelled"
        for req in install.requirements:
            wheel = PROJECT_WHEEL.fullmatch(req)
            if wheel:
                resolving += project_requirements(wheel["extras"].split(","))
            elif req in BUILT_WITHOUT_REQUIREMENTS:
                continue
            elif req.startswith(("/", "$", ".")):
                raise ValueError(f"{target}: local requirement {req} is not modelled by this test")
            else:
                resolving.append(req)
    return resolving, overrides, index_options


def platform_options() -> list[str]:
    """pip's target options for the GPU images: every manylinux tag their glibc accepts (pip does
    not widen a given --platform to older tags itself) and Ubuntu's CPython."""
    ubuntu = cuda_base_ubuntu()
    major, newest = UBUNTU_GLIBC[ubuntu]
    tags = [f"manylinux_{major}_{minor}_x86_64" for minor in range(newest, 4, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    options = [opt for tag in tags for opt in ("--platform", tag)]
    return [*options, "--python-version", UBUNTU_PYTHON[ubuntu], "--implementation", "cp"]


def dry_run(requirements: list[str], options: list[str], report: Path) -> list[dict]:
    """pip's resolver for the images' platform; the report's installs, or an error with pip's words."""
    command = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
        "--ignore-installed", "--timeout", "60", "--retries", "2",
        *platform_options(), *options, *requirements,
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, f"pip cannot resolve {report.stem}:\n{proc.stderr[-3000:]}"
    return [item["metadata"] for item in json.loads(report.read_text())["install"]]


def resolve(target: str, tmp: Path) -> dict[str, str]:
    """One image's packages (canonical name → version) as its pip installs leave them."""
    requirements, overrides, index_options = image_requirements(target)
    sdists = [r for r in requirements if canonicalize_name(Requirement(r).name) in SDIST_ONLY]
    built = tmp / f"{target}-built"
    options = ["--only-binary=:all:", *index_options]
    if sdists:
        command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(built)]
        proc = subprocess.run([*command, *sdists], capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"cannot build {sdists} for {target}:\n{proc.stderr[-3000:]}"
        options += ["--find-links", str(built)]
    found = dry_run(requirements, options, tmp / f"{target}.json")
    return {canonicalize_name(meta["name"]): meta["version"] for meta in found} | overrides


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Each image's packages, one image after the other (pip's downloads of wheels without
    separate metadata need disk space while it resolves)."""
    tmp = tmp_path_factory.mktemp("image-resolve")
    return {target: resolve(target, tmp) for target in IMAGES}


def _family(packages: dict[str, str], prefix: str) -> dict[str, str]:
    return {name: version for name, version in packages.items() if name.startswith(prefix)}


def test_one_torch_across_trainer_and_rollout(images: dict[str, dict[str, str]]) -> None:
    torch = {target: packages.get("torch") for target, packages in images.items()}
    assert set(torch.values()) == {GLOBAL_ARGS["TORCH_VERSION"]}, torch


def test_one_nccl_wheel_across_trainer_and_rollout(images: dict[str, dict[str, str]]) -> None:
    """NCCL refuses a communicator whose ranks run different releases, and two NCCL wheels in one
    image (cu12 beside cu13) overwrite each other's libnccl.so.2."""
    nccl = {target: _family(packages, "nvidia-nccl-") for target, packages in images.items()}
    assert all(len(wheels) == 1 for wheels in nccl.values()), f"one NCCL wheel per image: {nccl}"
    assert nccl["trainer"] == nccl["rollout"], f"trainer and rollout run different NCCL wheels: {nccl}"
    ((_, version),) = nccl["trainer"].items()
    assert version == build_args("trainer")["NCCL_VERSION"]
    assert Version(version) >= Version("2.31"), "DeepEP v2's GIN on EFA needs NCCL >= 2.31"


def test_one_cuda_major_the_base_images(images: dict[str, dict[str, str]]) -> None:
    """Every CUDA wheel of both images (the cuda-toolkit metapackage torch pins, the CUDA runtime,
    each `-cuNN` library) is for the base image's CUDA major, whose nvcc builds DeepEP. A library
    shipped once per CUDA may carry another major's variant beside the base's own:
    nvidia-cutlass-dsl 4.8.0 always requires its -cu12 libs, and vLLM's [cu13] extra adds -cu13."""
    base = GLOBAL_ARGS["CUDA_BASE"].split("@")[0].rpartition(":")[2].split(".")[0]
    for target, packages in images.items():
        majors = {name: m.group(1) for name in packages if (m := re.search(r"-cu(?:da)?(\d+)x?$", name))}
        for meta in ("cuda-toolkit", "nvidia-cuda-runtime"):
            assert meta in packages, f"{target}: torch's CUDA wheels ({meta}) are missing: not a CUDA build?"
            majors[meta] = packages[meta].split(".")[0]
        wrong = {
            name: major
            for name, major in majors.items()
            if major != base and name.rsplit("-cu", 1)[0] + f"-cu{base}" not in packages
        }
        assert not wrong, f"{target}: CUDA wheels not for the base image's CUDA {base}: {wrong}"


def test_the_rollout_runs_the_vllm_whose_python_ci_runs(images: dict[str, dict[str, str]]) -> None:
    assert images["rollout"].get("vllm") == build_args("rollout")["VLLM_VERSION"]
    assert "vllm" not in images["trainer"] and "deepspeed" not in images["rollout"]


def test_one_nvshmem_wheel_the_one_deepep_was_linked_with(images: dict[str, dict[str, str]]) -> None:
    """Both images run ep-build's deep_ep wheel, linked against NVSHMEM_VERSION (and NCCL_VERSION):
    each ends with exactly that NVSHMEM wheel, whatever torch or vLLM required."""
    for target, packages in images.items():
        nvshmem = _family(packages, "nvidia-nvshmem-")
        assert list(nvshmem.values()) == [build_args("ep-build")["NVSHMEM_VERSION"]], f"{target}: {nvshmem}"


def test_accepted_all2all_backends_find_their_packages(images: dict[str, dict[str, str]]) -> None:
    """Every all2all backend admission accepts (tests/support/all2all_images.accepted, the CRD's
    rules run offline) starts in the rollout image: the modules vLLM needs for it are installed by
    the rollout stage itself (the deep_ep wheel) or come with its resolved packages (flashinfer-python,
    a requirement of vllm's CUDA wheel)."""
    rollout = images["rollout"]
    local = {req for install in pip_installs("rollout") for req in install.requirements}
    for backend in sorted(all2all_images.accepted()):
        for module in all2all_images.NEEDS[backend]:
            if module in all2all_images.INSTALLED_BY_THE_DOCKERFILE:
                assert all2all_images.INSTALLED_BY_THE_DOCKERFILE[module] in local, (backend, module)
                continue
            dist = all2all_images.RESOLVED_WITH_VLLM.get(module)
            assert dist is not None and dist in rollout, (
                f"all2allBackend {backend} is accepted, but the rollout image has no {dist or module}"
            )
