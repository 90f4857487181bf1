"""DeepEP imports in a trainer whose NCCL already loaded the EFA net plugin (grpo_wire.deepep_import).

DeepEP's import check (pinned commit, `deep_ep/__init__.py` `check_nccl_so`) refuses any second
mapped file whose path contains "libnccl", which the aws-ofi-nccl plugin's does. The condition is
reproduced on CPU as far as it goes: a fresh interpreter maps files named like NCCL's runtime and
the plugin's (as the dynamic loader would: a file mapping shows its path in /proc/self/maps), and a
stand-in `deep_ep` package asserts at import exactly the pinned check's condition. A plain import
fails there; the product path passes, and still refuses a second runtime or a different build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from grpo_wire.deepep_import import nccl_files, runtime_problem

STAND_IN = textwrap.dedent(
    """
    import os
    from pathlib import Path

    # the pinned check's condition: every mapped path containing "libnccl" is one file
    if os.environ.get("EP_SUPPRESS_NCCL_CHECK", "0") in ("", "0"):
        mapped = {l.split()[-1] for l in Path("/proc/self/maps").read_text().splitlines() if "libnccl" in l}
        assert len(mapped) <= 1, f"Duplicate NCCL runtime found in the current system: {sorted(mapped)}"
    ElasticBuffer = type("ElasticBuffer", (), {})
    __version__ = "stand-in"
    """
)
FIND_PKGS = "import os\n\ndef find_nccl_root():\n    return os.environ['STAND_IN_NCCL_ROOT']\n"

SCENARIO = textwrap.dedent(
    """
    import mmap, os, sys
    from pathlib import Path

    root, scenario = Path(sys.argv[1]), sys.argv[2]
    def mapped(path, data):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        with path.open("rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays mapped while referenced
    import torch  # a CUDA build maps its NCCL runtime here, as in the trainer
    from grpo_wire.deepep_import import mapped_runtimes

    (root / "nccl/lib").mkdir(parents=True)
    keep, torchs = [], mapped_runtimes()
    if torchs:  # DeepEP links the same build: the very file
        (root / "nccl/lib/libnccl.so.2").symlink_to(next(iter(torchs)))
    else:  # a CPU torch: its stand-in, the same bytes as what DeepEP links
        keep.append(mapped(root / "torch/lib/libnccl.so.2", b"nccl 2.28 build" * 64))
        (root / "nccl/lib/libnccl.so.2").write_bytes(b"nccl 2.28 build" * 64)
    keep.append(mapped(root / "ofi/lib/libnccl-net-ofi.so", b"aws-ofi-nccl" * 64))  # at first communicator
    keep.append(mapped(root / "ofi/lib/libnccl-ofi-tuner.so", b"tuner" * 64))
    if scenario == "second runtime":
        keep.append(mapped(root / "other/lib/libnccl.so.2", b"nccl 2.28 build" * 64))
    if scenario == "other build":
        (root / "nccl/lib/libnccl.so.2").unlink()
        (root / "nccl/lib/libnccl.so.2").write_bytes(b"nccl 2.27 build" * 64)
    if scenario == "plain import":
        try:
            import deep_ep
        except AssertionError as e:
            print("REFUSED", e)
        raise SystemExit(0)
    from grpo_wire.deepep_import import import_deep_ep
    cls, why = import_deep_ep("ElasticBuffer")
    print("IMPORTED" if cls is not None else "REFUSED", why)
    print("SUPPRESS LEFT" if "EP_SUPPRESS_NCCL_CHECK" in os.environ else "ENV CLEAN")
    """
)


def run(tmp_path: Path, scenario: str, **env: str) -> str:
    package = tmp_path / "pkgs" / "deep_ep"
    (package / "utils").mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    (package / "utils" / "__init__.py").write_text("")
    (package / "utils" / "find_pkgs.py").write_text(FIND_PKGS)
    files = tmp_path / "files"
    path = os.pathsep.join([str(tmp_path / "pkgs"), os.environ.get("PYTHONPATH", "")])
    full = dict(os.environ, PYTHONPATH=path, STAND_IN_NCCL_ROOT=str(files / "nccl"), **env)
    done = subprocess.run(
        [sys.executable, "-c", SCENARIO, str(files), scenario],
        env=full, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_plugin_mapping_fails_deepeps_own_check_as_on_every_efa_node(tmp_path):
    out = run(tmp_path, "plain import")
    assert out.startswith("REFUSED") and "libnccl-net-ofi.so" in out


@pytest.mark.slow
def test_the_product_import_passes_with_one_runtime_and_nccls_plugins_and_leaves_the_env_as_it_was(tmp_path):
    out = run(tmp_path, "efa")
    assert out.splitlines() == ["IMPORTED ", "ENV CLEAN"]


@pytest.mark.slow
def test_a_second_nccl_runtime_is_still_refused_with_both_paths(tmp_path):
    out = run(tmp_path, "second runtime")
    assert out.startswith("REFUSED deep_ep refused: two NCCL runtimes")
    assert out.count("libnccl.so") == 2 and "other/lib/libnccl.so.2" in out


@pytest.mark.slow
def test_a_runtime_that_is_not_the_build_deepep_links_is_refused(tmp_path):
    out = run(tmp_path, "other build")
    assert out.startswith("REFUSED") and "is not the build DeepEP links" in out


@pytest.mark.slow
def test_a_user_who_turned_the_check_off_gets_deepeps_import_as_shipped(tmp_path):
    out = run(tmp_path, "second runtime", EP_SUPPRESS_NCCL_CHECK="1")
    assert out.startswith("IMPORTED")


@pytest.mark.parametrize(
    ("name", "runtime"),
    [
        ("libnccl.so.2", True),
        ("libnccl.so.2.28.3", True),
        ("libnccl.so", True),
        ("libnccl-net.so", False),
        ("libnccl-net-ofi.so", False),
        ("libnccl-ofi-tuner.so", False),
        ("libnccl-tuner-example.so", False),
    ],
)
def test_runtimes_are_told_from_plugins_by_file_name(name, runtime):
    path = f"/opt/x/lib/{name}"
    maps = f"7f00-7f10 r-xp 00000000 08:01 42 {path}\n7f10-7f20 r--p 00000000 08:01 7 /usr/lib/libc.so.6\n"
    assert nccl_files(maps) == (({path}, set()) if runtime else (set(), {path}))


def test_no_runtime_mapped_yet_is_no_problem_and_two_are():
    assert runtime_problem(set(), []) is None
    assert "two NCCL runtimes" in runtime_problem({"/a/libnccl.so.2", "/b/libnccl.so.2"}, [])
