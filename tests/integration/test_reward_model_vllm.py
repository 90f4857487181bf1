"""The reward model server on vLLM's engine (spec.reward.model.engine: vllm), run for real on vLLM's
CPU build: `python -m grpo_rollout reward` under the vLLM venv, each kind scoring over HTTP exactly
what the torch engine scores in this process for the same model and items.

- classifier: vLLM's pooling runner gives the head's logit (not its sigmoid), the torch score;
- generative judge over tensorParallelSize 2 (two vLLM CPU workers, one core each): the same greedy
  texts as transformers', so the same scores and the same parse failures.
An item past the model's context (256 and 512 tokens here) scores 0 with the reason on either kind; the
others in its batch are scored.
"""

import math
import signal
import time

import pytest
from grpo_operator.api.spec import RewardModelSpec
from grpo_rollout.reward_model.base import LoadConfig, load
from grpo_wire.protocol import ScoreItem

from tests.support.ports import free_port
from tests.support.reward import (
    build_reward_classifier,
    http,
    score,
    start_reward_server,
    write_reward_contract,
)
from tests.support.reward_processes import in_session
from tests.support.rollout import build_tiny_model, stop_server, wait_ready
from tests.support.vllm import VLLM_ENV, vllm_venv_python

pytestmark = pytest.mark.slow
TOKEN = "job-token"
# The reward engine sizes its own CPU KV cache; the rollout tests' fixed 1 GiB would skip that path.
ENV = {k: v for k, v in VLLM_ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
ITEMS = [
    {"prompt": "3+4=", "completion": "7"},
    {"prompt": [{"role": "user", "content": "a longer question here"}], "completion": "and a long answer"},
    {"prompt": "1+1=", "completion": "11", "columns": {"answer": "2"}},
]
LONG = {"prompt": "1+1=", "completion": "2" * 1000}  # the character tokenizer: 1000+ tokens
JUDGE = {
    "kind": "generative",
    "prompt": "Rate: {prompt} -> {completion}",
    "maxNewTokens": 12,
    "batchSize": 2,  # three items: vLLM still takes them as one list
}


def serve_and_score(tmp, model_dir, model: dict) -> tuple[dict, dict]:
    """(the /score answer, /health) of one reward server on vLLM for `model`."""
    port = free_port()
    spec = {"path": str(model_dir), "engine": "vllm", **model}
    contract = write_reward_contract(tmp / "job.json", model_dir, spec, reward_ports=[port])
    proc = start_reward_server(
        contract, 0, TOKEN, log_path=tmp / "reward.log", python=str(vllm_venv_python()), env=ENV
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout=240)
        status, body = score(url, [*ITEMS, LONG], TOKEN)
        assert status == 200, body
        _, health = http("GET", f"{url}/health")
        *scored, long = zip(body["scores"], body["errors"], strict=True)
        assert long[0] == 0.0 and long[1] and "tokens" in long[1], long
        assert "is over the" in long[1] and "the reward server takes" in long[1], long
        proc.send_signal(signal.SIGTERM)  # as the kubelet stops a pod: vLLM's engine processes end too
        assert proc.wait(timeout=60) == 0
        # its engine processes end with it; one may still be exiting (not yet reaped) as it returns
        deadline = time.monotonic() + 10
        while in_session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert in_session(proc.pid) == [], "vLLM engine processes outlived the reward server"
        return {"scores": [s for s, _ in scored], "errors": [e for _, e in scored]}, health
    finally:
        stop_server(proc)


def torch_scores(model_dir, model: dict) -> tuple[list[float], list[str | None]]:
    spec = RewardModelSpec.model_validate({"path": str(model_dir), **model})
    local = load(str(spec.kind), LoadConfig(str(model_dir), "cpu"), spec)
    return local.score([ScoreItem.model_validate(item) for item in ITEMS])


def test_a_classifier_on_vllm_scores_the_logit_the_torch_engine_scores(tmp_path):
    classifier = build_reward_classifier(tmp_path / "rm", hidden=128)  # head_dim 32: CPU attention's
    body, health = serve_and_score(tmp_path, classifier, {})
    assert health["engine"] == "reward-classifier-vllm"
    expected, _ = torch_scores(classifier, {})
    assert body["errors"] == [None] * len(ITEMS)
    assert body["scores"] == pytest.approx(expected, abs=1e-4)
    assert len({round(s, 4) for s in body["scores"]}) == len(ITEMS)  # really per item, not one value
    assert not any(0 < s < 1 and math.isclose(s, 1 / (1 + math.exp(-e)), abs_tol=1e-4)
                   for s, e in zip(body["scores"], expected, strict=True) if abs(e) > 1e-3)  # fmt: skip


def test_a_judge_on_vllm_over_two_tensor_parallel_workers_writes_what_transformers_writes(tmp_path):
    policy = build_tiny_model(tmp_path / "judge", arch="qwen2", hidden=128)  # head_dim 32
    body, health = serve_and_score(tmp_path, policy, {**JUDGE, "tensorParallelSize": 2})
    assert health["engine"] == "reward-generative-vllm"
    log = (tmp_path / "reward.log").read_text()
    assert "tensor_parallel_size': 2" in log or "tensor_parallel_size=2" in log, log[-3000:]
    scores, errors = torch_scores(policy, {**JUDGE, "engine": "torch"})
    # a text without a number scores 0 with a preview of the text: equal errors are equal texts
    assert (body["scores"], body["errors"]) == (scores, errors)
    assert any(s != 0 for s in scores) and any(e is not None for e in errors)  # both paths compared
