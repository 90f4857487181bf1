"""Fixtures of the integration ring shared by several modules.

`tiny_model` (session): the demo's warmed-up tiny model, built once by `grpo-operator tiny-model`
(what a user runs), for the local-runtime tests (test_local_runtime*.py).
"""

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.getbasetemp() / "tiny-model"
    subprocess.run(
        [sys.executable, "-m", "grpo_operator.cli", "tiny-model", str(out)], check=True, timeout=600
    )
    return out
