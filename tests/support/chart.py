"""The Helm chart rendered by the real helm binary (hack/build-control-plane.sh builds it), for the
chart tests and the tests that hold other code to what the chart ships (escalation policy, monitoring)."""

import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "grpo-operator"
NAMESPACE = "grpo-system"


def _bin_dir() -> Path:
    out = subprocess.run(
        ["bash", str(ROOT / "hack" / "build-control-plane.sh"), "print-bin-dir"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return Path(out.stdout.strip())


HELM = _bin_dir() / "helm"


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def render(*sets: str) -> list[dict[str, Any]]:
    """`helm template` of the chart with `--set` values, as a list of objects."""
    args = ["template", "grpo", str(CHART), "--namespace", NAMESPACE]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]
