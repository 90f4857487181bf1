"""A reward model that keeps failing fails the job with a named reason instead of stalling it: the
rollout server's reward model endpoint answers nothing (no reward pod listens), so every /generate
ends in 502 `reward_unavailable`; the trainer retries for 10 x spec.reward.model.timeoutSeconds,
saying so, then exits EXIT_CONFIG stating RewardModelUnavailable (the job's Failed reason) with the
servers' last errors.
"""

import json

import pytest
from grpo_operator.api.contract import EXIT_CONFIG

from tests.support import trainer_run
from tests.support.ports import free_port
from tests.support.reward import write_reward_contract
from tests.support.rollout import build_tiny_model, start_server, stop_server, wait_ready

pytestmark = pytest.mark.slow
TOKEN = trainer_run.TOKEN
TIMEOUT_S = 1.0  # spec.reward.model.timeoutSeconds: the job fails after 10 s of no score


def test_the_trainer_fails_the_job_when_the_reward_model_answers_nothing(tmp_path):
    policy = build_tiny_model(tmp_path / "policy", arch="qwen3_moe")
    reward_port, rollout_port = free_port(), free_port()  # nothing will listen on reward_port
    model = {"path": str(policy), "timeoutSeconds": TIMEOUT_S}
    functions = [{"builtin": "exact_match"}]
    contract = write_reward_contract(
        tmp_path / "job.json",
        policy,
        model,
        reward_ports=[reward_port],
        rollout_ports=[rollout_port],
        functions=functions,
    )
    server = start_server(contract, rollout_port, TOKEN, log_path=tmp_path / "rollout.log")
    try:
        wait_ready(f"http://127.0.0.1:{rollout_port}", server)
        data = tmp_path / "rows.jsonl"
        data.write_text(
            "".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n" for i in range(8))
        )
        work = tmp_path / "trainer"
        work.mkdir()
        trainer_contract = trainer_run.write_contract(
            work,
            policy,
            rollout_port,
            dataset=str(data),
            maxSteps=2,
            reward={"functions": functions, "model": model},
            reward_ports=(reward_port,),
        )
        proc = trainer_run.start_trainer(trainer_contract, work)
        assert trainer_run.finish(proc, work, timeout=240) == EXIT_CONFIG, trainer_run.log_tail(work)
    finally:
        stop_server(server)
    log = (work / "trainer.log").read_text()
    # it retried, bounded and saying how long it would, before failing
    assert "the reward model servers answered no rollout server for" in log
    # the termination message the operator fails the job with: the reason, the budget, the cause
    assert "RewardModelUnavailable: the reward model servers (spec.reward.model" in log
    assert "10 x spec.reward.model.timeoutSeconds = 10s" in log
    assert "reward_unavailable" in log and f"127.0.0.1:{reward_port}" in log
