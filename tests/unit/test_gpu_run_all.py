"""The GPU entry script (`benchmarks/gpu/run_all.py`) on this CPU machine, and its wheelhouse list.

No GPU here: every section must say so in the table, by name, and the script still exits 0. The
wheelhouse (`benchmarks/gpu/wheelhouse.sh`) must be what the sections need on a machine that has
torch alone: the sections' modules are imported, and the trainer's FSDP2 step and export run for
real on CPU (gloo), in `python -S` with a site folder holding only torch's requirement closure and
the listed wheels (this venv's copies, at hack/requirements.lock's versions, which wheelhouse.sh
downloads); every listed wheel must be used. `--setup-only` takes every section up to its first
CUDA step (its own process group where it has one: DeepEP v2's gate refuses there, on gloo), the
wheelhouse's per-Python plan serves each Python from pyproject.toml's floor up to 3.12 and names
the rest, and run_all.py unpacks only the wheels its interpreter loads.
"""

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))
import run_all  # noqa: E402


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_list() -> dict[str, str]:
    """name -> version of the WHEELS array in wheelhouse.sh, at hack/requirements.lock's pins."""
    block = re.search(r"WHEELS=\((.*?)\)", (GPU / "wheelhouse.sh").read_text(), re.S)
    assert block, "wheelhouse.sh has no WHEELS=( ... ) list"
    lines = (ROOT / "hack" / "requirements.lock").read_text().splitlines()
    pins = {canonical(n): v for n, v in (x.split("==") for x in lines if "==" in x)}
    names = block.group(1).split()
    missing = [n for n in names if canonical(n) not in pins]
    assert not missing, f"wheelhouse.sh lists wheels hack/requirements.lock does not pin: {missing}"
    return {n: pins[canonical(n)] for n in names}


def requirement_closure(names: list[str]) -> set[str]:
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def top_levels(dist: str) -> set[str]:
    found = md.distribution(dist)
    tops = {Path(str(f)).parts[0] for f in found.files or []}
    return {
        t.removesuffix(".py") for t in tops if not t.endswith((".dist-info", ".pth", ".data")) and t != ".."
    }


def test_on_cpu_every_section_says_it_needs_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(GPU / "run_all.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {name: r for name, r, _ in json.loads(out.read_text())["rows"]}
    assert set(rows) == {s.name for s in run_all.SECTIONS}
    assert sum(s.budget_s for s in run_all.SECTIONS) < 8 * 60  # the whole run fits the lent time
    for name, r in rows.items():
        assert r["status"] == "skipped (needs CUDA: no CUDA device visible)", name
        assert re.search(rf"^{name}\s+skipped \(needs CUDA", proc.stdout, re.M), proc.stdout


@pytest.mark.slow
def test_the_wheelhouse_is_what_the_sections_need_beside_torch(tmp_path):
    wheels = wheel_list()
    for name, version in wheels.items():  # the bare run below uses this venv's copies: same versions
        assert md.version(name) == version, (
            f"hack/requirements.lock pins {name}=={version}, the venv has {md.version(name)}: make setup"
        )
    site = tmp_path / "site"
    site.mkdir()
    for dist in requirement_closure(["torch"]) | set(wheels):
        found = md.distribution(dist)
        for top in {Path(str(f)).parts[0] for f in found.files or []}:
            src = Path(found.locate_file(top))
            if top != ".." and not top.endswith(".pth") and src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    probe = (
        "import importlib, json, sys, run_all\n"
        "for s in run_all.SECTIONS:\n"
        "    [importlib.import_module(m) for m in s.modules]\n"
        "rows = [run_all.fsdp2_step('cpu'), run_all.hf_export('cpu')]\n"
        "print(json.dumps({'rows': rows, 'modules': sorted({m.split('.')[0] for m in sys.modules})}))\n"
    )
    sources = [str(p) for p in run_all.SOURCES]
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.pathsep.join([*sources, str(site)]),
        "HOME": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["status"] for r in result["rows"]] == ["ok", "ok"], result["rows"]
    unused = [name for name in wheels if not top_levels(name) & set(result["modules"])]
    assert unused == [], f"wheelhouse.sh carries wheels nothing imports: {unused}"


def run_script(*args: str, python: str = sys.executable, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, str(GPU / "run_all.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.mark.slow
def test_setup_only_takes_every_section_up_to_its_cuda_need(tmp_path):
    from grpo_trainer.moe.backends import deepep_v2

    out = tmp_path / "gpu.json"
    proc = run_script("--setup-only", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {name: r for name, r, _ in json.loads(out.read_text())["rows"]}
    assert set(rows) == {s.name for s in run_all.SECTIONS}
    for section in run_all.SECTIONS:
        r, steps = rows[section.name], rows[section.name]["detail"]["setup"]
        assert r["status"] == f"ready up to: {r['stop']}", (section.name, r)
        assert steps[:2] == [f"imported {', '.join(section.modules)}", "device cpu (no CUDA)"], steps
        groups = [s for s in steps if s.startswith("process group gloo world 1 at 127.0.0.1:")]
        assert len(groups) == section.group, (section.name, steps)  # its own group, or none
        assert (steps[-1] == "process group destroyed") == section.group, (section.name, steps)
    gate = deepep_v2.WHY if not deepep_v2.AVAILABLE else "DeepEP needs CUDA GPUs"
    assert rows["deepep"]["stop"] == f"DeepEP v2 refused: {gate}"
    assert f"deepep_v2 gate over a gloo group: {gate}" in rows["deepep"]["detail"]["setup"]
    assert (
        rows["ep_nccl_world1"]["stop"]
        == "needs CUDA: the all-to-all is checked over NCCL, this group is gloo"
    )
    assert (
        "gloo dispatcher of 128 experts over the default group" in rows["ep_nccl_world1"]["detail"]["setup"]
    )
    others = {s.name for s in run_all.SECTIONS if not s.group}
    assert {rows[n]["stop"] for n in others} == {"needs CUDA: its first step runs CUDA kernels"}


def plan() -> dict[str, str]:
    proc = subprocess.run(
        ["bash", str(GPU / "wheelhouse.sh"), "--plan"], capture_output=True, text=True, timeout=60, check=True
    )
    return dict(line.split(": ", 1) for line in proc.stdout.splitlines())


def test_the_wheelhouse_plan_serves_every_python_from_the_floor_and_names_the_rest():
    pins = {f"{canonical(n)}=={v}" for n, v in wheel_list().items()}
    floor = run_all.wheels.python_floor()
    got = plan()
    assert set(got) == {"python 3.10", "python 3.11", "python 3.12"}
    for version in ("3.10", "3.11", "3.12"):
        if tuple(map(int, version.split("."))) < floor:
            assert got[f"python {version}"] == "not served: below requires-python >=3.11 (pyproject.toml)"
        else:
            assert {
                canonical(p.split("==")[0]) + "==" + p.split("==")[1]
                for p in got[f"python {version}"].split()
            } == pins


# file names as wheelhouse.sh downloaded them for 3.11 and 3.12 at the lock's versions (a subset)
DOWNLOADED = [
    "annotated_types-0.8.0-py3-none-any.whl",
    "numpy-2.4.6-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    "numpy-2.4.6-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    "pydantic_core-2.50.5-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "pyyaml-6.0.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
    "pyyaml-6.0.4-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
    "safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
]


def test_run_all_unpacks_the_wheels_its_python_loads():
    select = run_all.wheels.select
    for v in ((3, 11), (3, 12)):
        chosen, missing = select(DOWNLOADED, v)
        assert missing == []
        assert [n for n in chosen if "-cp3" in n and "abi3" not in n] == [
            n for n in sorted(DOWNLOADED) if f"-cp{v[0]}{v[1]}-cp{v[0]}{v[1]}-" in n
        ]
        assert {n.split("-")[0] for n in chosen} == {n.split("-")[0] for n in DOWNLOADED}  # one each
    assert select(DOWNLOADED, (3, 10))[1] == ["numpy", "pydantic-core", "pyyaml"]  # abi3 and pure ones load
    assert select(DOWNLOADED, (3, 12), machine="aarch64")[1] == [
        "numpy",
        "pydantic-core",
        "pyyaml",
        "safetensors",
        "tokenizers",
    ]
    with pytest.raises(ValueError, match="two wheels of numpy"):
        select([*DOWNLOADED, "numpy-2.3.0-cp312-cp312-manylinux_2_28_x86_64.whl"], (3, 12))


def python_310() -> str | None:
    """A Python 3.10 interpreter on this machine (pyenv's, or one on PATH), or None."""
    import glob
    import shutil

    for candidate in [
        shutil.which("python3.10"),
        *glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python")),
    ]:
        if candidate and subprocess.run([candidate, "-V"], capture_output=True, check=False).returncode == 0:
            return candidate
    return None


def test_on_a_python_below_the_floor_every_row_says_which_python_it_needs(tmp_path):
    python = python_310()
    if python is None:
        pytest.skip("no Python 3.10 interpreter on this machine")
    out = tmp_path / "gpu.json"
    proc = run_script("--json", str(out), python=python, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    assert record["python"].startswith("3.10.") and record["wheels"] == []
    statuses = {r["status"] for _, r, _ in record["rows"]}
    assert statuses == {
        "skipped (needs Python >= 3.11 (pyproject.toml requires-python; the lock's transformers, "
        "numpy and httpx2 too), this is 3.10)"
    }


@pytest.mark.slow
@pytest.mark.waits
def test_the_real_wheelhouse_serves_each_python_from_the_floor(tmp_path):
    dest = tmp_path / "whl"
    proc = subprocess.run(
        ["bash", str(GPU / "wheelhouse.sh"), str(dest)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # also: wheels and checkout under 64 MiB
    names = [p.name for p in dest.glob("*.whl")]
    expected = {canonical(n) for n in wheel_list()}
    for version in ((3, 11), (3, 12)):
        chosen, missing = run_all.wheels.select(names, version)
        assert missing == [] and {run_all.wheels.tags(n)[0] for n in chosen} == expected, version


def test_the_rollout_image_section_runs_under_the_env_the_operator_renders_for_a_deepep_v2_server():
    from grpo_operator.render.pods import GIN_ENV
    from grpo_rollout.engines import vllm_deepep

    env = dict(run_all.ROLLOUT_EFA_ENV)
    assert env.pop(vllm_deepep.ENV) == "deepep_v2" and env.pop("FI_PROVIDER") == "efa"
    assert env == GIN_ENV
