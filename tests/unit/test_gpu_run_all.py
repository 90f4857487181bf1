"""The GPU entry script (`benchmarks/gpu/run_all.py`) on this CPU machine, and its wheelhouse list.

No GPU here: every section must say so in the table, by name, and the script still exits 0. The
wheelhouse (`benchmarks/gpu/wheelhouse.sh`) must be what the sections need on a machine that has
torch alone: the sections' modules are imported, and the trainer's FSDP2 step and export run for
real on CPU (gloo), in `python -S` with a site folder holding only torch's requirement closure and
the listed wheels (this venv's copies, at hack/requirements.lock's versions, which wheelhouse.sh
downloads); every listed wheel must be used.
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
