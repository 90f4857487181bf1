"""Real reward model servers for the tests: a tiny model, a run contract with spec.reward.model and
contract.reward, and `python -m grpo_rollout reward` child processes on loopback, as in a reward pod.

The classifier is the product's tiny builder (`grpo-operator tiny-model --reward-classifier`, random
weights); the judge is the tiny policy (`tests.support.rollout.build_tiny_model`).
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from grpo_operator.api.contract import RewardTopology, RunContract

from tests.support.rollout import write_contract


def build_reward_classifier(directory: str | Path, **options: Any) -> Path:
    from grpo_trainer.tiny_model import TinyConfig, save_reward_classifier

    return save_reward_classifier(Path(directory), TinyConfig(**options))


def write_reward_contract(
    path: str | Path,
    policy_dir: str | Path,
    model: dict[str, Any],
    *,
    reward_ports: list[int],
    rollout_ports: list[int] | None = None,
    functions: list[dict] | None = None,
) -> Path:
    """A run contract whose spec.reward.model is `model` (its YAML spelling) served on loopback
    `reward_ports` (contract.reward), the rollout servers on `rollout_ports` serving `policy_dir`."""
    reward: dict[str, Any] = {"model": {"replicas": len(reward_ports), **model}}
    if functions:
        reward["functions"] = functions
    out = write_contract(path, policy_dir, ports=rollout_ports or [1], spec_extra={"reward": reward})
    contract = RunContract.model_validate_json(out.read_text())
    contract.reward = RewardTopology(
        service="test-reward",
        replicas=len(reward_ports),
        port=reward_ports[0],
        endpoints=[f"http://127.0.0.1:{p}" for p in reward_ports],
    )
    out.write_text(contract.model_dump_json(by_alias=True))
    return out


def start_reward_server(
    contract: str | Path, index: int, token: str, *, log_path: str | Path | None = None
) -> subprocess.Popen:
    """`python -m grpo_rollout reward` as the reward pod `index` of `contract` (its endpoint's port)."""
    env = dict(
        os.environ,
        GRPO_CONTRACT=str(contract),
        GRPO_TOKEN=token,
        GRPO_POD_INDEX=str(index),
        HF_HUB_OFFLINE="1",
    )
    cmd = [sys.executable, "-m", "grpo_rollout", "reward", "--threads", "1", "--drain-seconds", "2"]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
