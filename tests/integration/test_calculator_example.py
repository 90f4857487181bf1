"""The calculator example (examples/tiny-local-calculator.yaml) as a user runs it: the tiny model built
for the task (`grpo-operator tiny-model DIR --task calculator`), then `grpo-operator run`. It cannot
compute 7^5 in its head; it learns to call the calculator, read the result and answer with it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.local_runtime import run_job

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_the_tiny_model_learns_to_use_the_calculator(tmp_path: Path) -> None:
    model = tmp_path / ".tiny-calculator"
    cmd = [sys.executable, "-m", "grpo_operator.cli", "tiny-model", str(model), "--task", "calculator"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    built = json.loads(out.strip().splitlines()[-1])
    assert 0.3 <= built["sampled_accuracy"] < 0.8, built  # signal to learn from, room to learn
    manifest = yaml.safe_load((REPO / "examples" / "tiny-local-calculator.yaml").read_text())
    manifest["spec"]["algorithm"]["maxSteps"] = 100
    run = run_job(tmp_path, manifest)
    assert run.finish(timeout=900) == 0, run.output()
    summary = run.summary()
    assert summary["steps"] == 100 and summary["restarts"] == 0, summary
    steps = run.steps()
    first, last = steps[:15], steps[-15:]
    mean = lambda part, key: sum(s[key] for s in part) / len(part)  # noqa: E731
    calls = lambda part: sum(s["metrics"]["tool_calls_per_episode"] for s in part) / len(part)  # noqa: E731
    print(f"calculator: reward {mean(first, 'reward_mean'):.3f} -> {mean(last, 'reward_mean'):.3f}, "
          f"calls/episode {calls(first):.2f} -> {calls(last):.2f}")  # fmt: skip
    assert mean(last, "reward_mean") > mean(first, "reward_mean") + 0.1, [s["reward_mean"] for s in steps]
    assert calls(last) > calls(first) and 0.0 < summary["masked_token_fraction"] < 0.5, summary
    assert 1.0 < summary["turns_mean"] <= 3.0, summary
