"""The reward model example (examples/tiny-local-reward-model.yaml) as a user runs it: both tiny
models built by `grpo-operator tiny-model` (the policy, and `--reward-classifier`), then
`grpo-operator run`, which starts the reward model servers as local processes beside the rollout
server and trainer. Then the same job with the tiny policy as a generative judge instead."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.local_runtime import run_job

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def manifest(tiny_model: Path, classifier: Path) -> dict:
    job = yaml.safe_load((REPO / "examples" / "tiny-local-reward-model.yaml").read_text())
    spec = job["spec"]
    spec["model"]["path"] = str(tiny_model)
    spec["dataset"]["path"] = str(tiny_model / "addition-train.jsonl")
    spec["reward"]["model"]["path"] = str(classifier)
    spec["algorithm"].update(maxSteps=STEPS, promptsPerStep=4, groupSize=4, microBatchSize=16)
    return job


def test_the_example_runs_with_the_classifier_and_with_the_policy_as_judge(
    tmp_path: Path, tiny_model: Path
) -> None:
    classifier = tmp_path / ".tiny-rm"
    cmd = [sys.executable, "-m", "grpo_operator.cli", "tiny-model", str(classifier), "--reward-classifier"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)

    job = manifest(tiny_model, classifier)
    (tmp_path / "classifier").mkdir()
    run = run_job(tmp_path / "classifier", job)
    assert run.finish(timeout=300) == 0, run.output()
    assert run.summary()["steps"] == STEPS and run.summary()["restarts"] == 0
    logs = run.workdir / "logs"
    for i in range(2):
        assert "ready: classifier" in (logs / f"reward-{i}.log").read_text()
    assert run.pod_pids() == {}

    judge = job["spec"]["reward"]["model"]
    judge.update(
        kind="generative",
        path=str(tiny_model),
        prompt="Is {completion} the sum {prompt}? The answer is {answer}. Score:",
        maxNewTokens=3,
        replicas=1,
    )
    (tmp_path / "judge").mkdir()
    run = run_job(tmp_path / "judge", job)
    assert run.finish(timeout=300) == 0, run.output()
    assert run.summary()["steps"] == STEPS
    assert "ready: generative" in (run.workdir / "logs" / "reward-0.log").read_text()
