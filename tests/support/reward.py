"""Real reward model servers for the tests: a tiny model, a run contract with spec.reward.model and
contract.reward, and `python -m grpo_rollout reward` child processes on loopback, as in a reward pod.

The classifier is the product's tiny builder (`grpo-operator tiny-model --reward-classifier`, random
weights); the judge is the tiny policy (`tests.support.rollout.build_tiny_model`).
"""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
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
    contract: str | Path,
    index: int,
    token: str,
    *,
    log_path: str | Path | None = None,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`python -m grpo_rollout reward` as the reward pod `index` of `contract` (its endpoint's port),
    under `python` (the vLLM venv's for engine vllm) with `env` added."""
    env = dict(
        os.environ,
        GRPO_CONTRACT=str(contract),
        GRPO_TOKEN=token,
        GRPO_POD_INDEX=str(index),
        HF_HUB_OFFLINE="1",
        **(env or {}),
    )
    cmd = [python, "-m", "grpo_rollout", "reward", "--threads", "1", "--drain-seconds", "2"]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def http(method: str, url: str, body: bytes | None = None, token: str | None = None) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one plain HTTP call, with the bearer `token` if given."""
    req = urllib.request.Request(url, data=body, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def score(url: str, items: list[dict[str, Any]], token: str) -> tuple[int, Any]:
    """POST /score of `items` (ScoreItem dicts)."""
    body = json.dumps({"request_id": "t", "items": items}).encode()
    return http("POST", f"{url}/score", body, token)


def metric(url: str, name: str) -> float:
    """The value of one unlabelled sample of a server's /metrics (0.0 when absent)."""
    _, text = http("GET", f"{url}/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0
