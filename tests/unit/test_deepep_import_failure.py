"""A DeepEP whose own import checks fail (AssertionError, not ImportError) on a real import.

DeepEP's `__init__` asserts at import time (`check_nccl_so`: two NCCL libraries loaded;
`find_cuda_home`: no CUDA). A tiny package named `deep_ep` that raises the same way is put on the
path of a fresh interpreter, which then imports our backends for real: registration must not
crash, `auto` must skip both DeepEP versions with that reason, and `epBackend: deepep` must fail
naming the component and what to change.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAILING_INIT = 'raise AssertionError("Duplicate NCCL runtime found in the current system: /a/libnccl.so.2")\n'

CHECKS = textwrap.dedent(
    """
    import os, tempfile
    import torch.distributed as dist
    from grpo_trainer.moe import BackendUnavailable, autoselect, available_backends, make_dispatcher

    names = available_backends()
    assert {"deepep", "deepep_v1", "deepep_v2"} <= set(names), names  # registered, to say why not
    across = autoselect.Layout(tuple(range(16)), 8, "cuda")
    inside = autoselect.Layout(tuple(range(8)), 8, "cuda")
    for layout, name in ((across, "deepep_v2"), (inside, "deepep_v1")):
        usable, refused = autoselect.candidates(layout, 64)
        assert name not in usable and "nccl" in usable, usable
        assert "AssertionError" in refused[name] and "Duplicate NCCL" in refused[name], refused
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        make_dispatcher("deepep", dist.group.WORLD, 8)
    except BackendUnavailable as e:  # the trainer fails the job with EPBackendUnavailable, no restarts
        message = str(e)
    else:
        raise SystemExit("epBackend deepep did not fail")
    for part in ("epBackend deepep", "deepep_v1", "AssertionError", "spec.trainer.epBackend"):
        assert part in message, (part, message)
    print("CHECKED")
    """
)


@pytest.mark.slow
def test_an_asserting_deepep_import_is_skipped_by_auto_and_refused_loudly_by_deepep(tmp_path: Path) -> None:
    package = tmp_path / "deep_ep"
    package.mkdir()
    (package / "__init__.py").write_text(FAILING_INIT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("LOCAL_WORLD_SIZE", None)
    done = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and "CHECKED" in done.stdout, done.stderr[-4000:]
