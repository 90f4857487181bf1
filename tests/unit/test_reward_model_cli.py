"""`python -m grpo_rollout reward` (and a rollout server with a reward model) refuse to start, with a
clear message, when their inputs are wrong: no reward model in the spec, no token, no model at the
path, a classifier with more than one output, reward servers missing from the contract."""

import json
import os
import subprocess
import sys

import pytest
from grpo_operator.api.contract import RunContract

from tests.support.reward import build_reward_classifier, write_reward_contract
from tests.support.rollout import build_tiny_model, write_contract


def run(command: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    return subprocess.run(
        [sys.executable, "-m", "grpo_rollout", command, *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_job_without_a_reward_model_and_a_missing_token_are_named(tmp_path):
    contract = write_contract(tmp_path / "job.json", tmp_path, ports=[18000])
    out = run("reward", {"GRPO_CONTRACT": str(contract)})
    assert out.returncode != 0 and "$GRPO_TOKEN is not set" in out.stderr
    out = run("reward", {"GRPO_CONTRACT": str(contract), "GRPO_TOKEN": "t"})
    assert out.returncode != 0 and "spec.reward.model is not set" in out.stderr


def test_a_path_without_a_model_exits_3_stating_the_reason_the_job_fails_with(tmp_path):
    """The trainer's path rule for its own model, in the reward pod (exit 3 is EXIT_CONFIG: the operator
    fails the job with the stated reason instead of restarting the pod)."""
    (tmp_path / "empty").mkdir()
    for path, reason in ((tmp_path / "missing", "PathNotFound"), (tmp_path / "empty", "PathEmpty")):
        contract = write_reward_contract(
            tmp_path / "job.json", tmp_path, {"path": str(path)}, reward_ports=[18004]
        )
        out = run("reward", {"GRPO_CONTRACT": str(contract), "GRPO_TOKEN": "t"}, "--port", "18004")
        assert out.returncode == 3, out.stderr
        assert f"{reason}: test-reward-0: spec.reward.model.path {path}" in out.stderr, out.stderr


@pytest.mark.slow
def test_a_two_output_classifier_stops_the_server_naming_the_field(tmp_path):
    rm = build_reward_classifier(tmp_path / "rm", hidden=32, layers=1)
    config = json.loads((rm / "config.json").read_text())  # num_labels is written as id2label
    config["id2label"], config["label2id"] = {"0": "bad", "1": "good"}, {"bad": 0, "good": 1}
    (rm / "config.json").write_text(json.dumps(config))
    contract = write_reward_contract(tmp_path / "job.json", tmp_path, {"path": str(rm)}, reward_ports=[18001])
    out = run("reward", {"GRPO_CONTRACT": str(contract), "GRPO_TOKEN": "t"}, "--port", "18001")
    assert out.returncode != 0
    assert "spec.reward.model.path" in out.stderr and "2 outputs (labels ['bad', 'good'])" in out.stderr


def test_a_rollout_server_with_a_reward_model_needs_the_contracts_reward_servers(tmp_path):
    policy = build_tiny_model(tmp_path / "policy", arch="qwen2", hidden=32, layers=1)
    contract = write_reward_contract(
        tmp_path / "job.json", policy, {"path": str(policy)}, reward_ports=[18002]
    )
    c = RunContract.model_validate_json(contract.read_text())
    c.reward = None  # what a contract rendered without the reward role would say
    contract.write_text(c.model_dump_json(by_alias=True))
    out = run("serve", {"GRPO_CONTRACT": str(contract), "GRPO_TOKEN": "t"}, "--port", "18003")
    assert out.returncode != 0
    assert "spec.reward.model is set but the run contract lists no reward servers" in out.stderr
