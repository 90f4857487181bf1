"""The generative judge over real HTTP: the tiny policy served by `python -m grpo_rollout reward` as
kind generative, and a rollout server whose completions it scores.

A judge text without a score scores 0, says why and is counted as a parse failure; a prompt template
naming a column the rows lack is a misconfiguration: 422 `reward_misconfigured` naming
spec.reward.model.prompt from /score, and the same code and message from the rollout server's
/generate (what the trainer stops on), never a silent reward of 0.
"""

import json

import pytest
from grpo_operator.api.contract import EXIT_CONFIG

from tests.support import trainer_run
from tests.support.ports import free_port
from tests.support.reward import http, metric, score, start_reward_server, write_reward_contract
from tests.support.rollout import build_tiny_model, start_server, stop_server, wait_ready

pytestmark = pytest.mark.slow
TOKEN = trainer_run.TOKEN  # the trainer test harness's token: one job, one token
JUDGE = {
    "kind": "generative",
    "prompt": "Rate the answer. Question: {prompt} Answer: {completion} Reference: {answer}",
    "scorePattern": r"SCORE=(\d+)",  # the random tiny policy never writes it: every text a parse failure
    "maxNewTokens": 6,
    "batchSize": 4,
    "timeoutSeconds": 30,
}


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """One judge server (the tiny policy) and one rollout server (the same policy) scoring with it;
    (judge url, rollout url, policy directory)."""
    tmp = tmp_path_factory.mktemp("judge")
    policy = build_tiny_model(tmp / "policy", arch="qwen3_moe")
    reward_port, rollout_port = free_port(), free_port()
    contract = write_reward_contract(
        tmp / "job.json",
        policy,
        {"path": str(policy), **JUDGE},
        reward_ports=[reward_port],
        rollout_ports=[rollout_port],
        functions=[{"builtin": "exact_match"}],
    )
    procs = [
        start_reward_server(contract, 0, TOKEN, log_path=tmp / "judge.log"),
        start_server(contract, rollout_port, TOKEN, log_path=tmp / "rollout.log"),
    ]
    urls = [f"http://127.0.0.1:{reward_port}", f"http://127.0.0.1:{rollout_port}"]
    try:
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        yield urls[0], urls[1], policy
    finally:
        for proc in procs:
            stop_server(proc)


def test_judge_texts_without_a_score_score_zero_say_why_and_are_counted(judge):
    url, _, _ = judge
    items = [
        {"prompt": f"{i}+1=", "completion": str(i + 1), "columns": {"answer": str(i + 1)}} for i in range(6)
    ]
    status, body = score(url, items, TOKEN)
    assert status == 200, body
    assert body["scores"] == [0.0] * 6
    assert all(e.startswith("no score in the judge's text: ") for e in body["errors"])
    assert metric(url, "grpo_reward_parse_failures_total") == 6
    assert metric(url, "grpo_reward_items_scored_total") == 6
    _, health = http("GET", f"{url}/health")
    assert health["engine"] == "reward-generative" and health["state"] == "ready"


def test_a_template_naming_a_missing_column_is_refused_naming_the_field(judge):
    url, _, _ = judge
    status, body = score(url, [{"prompt": "1+1=", "completion": "2", "columns": {"solution": "2"}}], TOKEN)
    assert (status, body["code"]) == (422, "reward_misconfigured")
    assert "spec.reward.model.prompt" in body["message"] and "{answer}" in body["message"]
    assert "'solution'" in body["message"]  # the names the row has


def test_the_rollout_server_fails_generate_with_the_judges_misconfiguration(judge):
    _, rollout, _ = judge
    request = {
        "request_id": "r",
        "n": 2,
        "prompts": [{"id": "a", "text": "1+1=", "columns": {"solution": "2"}}],
    }
    status, body = http("POST", f"{rollout}/generate", json.dumps(request).encode(), TOKEN)
    assert (status, body["code"]) == (422, "reward_misconfigured")
    assert "spec.reward.model.prompt" in body["message"] and "{answer}" in body["message"]

    request["prompts"][0]["columns"] = {"answer": "2"}  # rows with the column: scored, 0 with the reason
    status, body = http("POST", f"{rollout}/generate", json.dumps(request).encode(), TOKEN)
    assert status == 200, body
    for c in body["results"][0]["completions"]:
        detail = {d["name"]: d for d in c["reward_details"]}
        assert detail["model"]["score"] == 0.0 and detail["model"]["error"].startswith("no score")
        assert c["reward"] == pytest.approx(detail["exact_match"]["score"])


def test_the_trainer_stops_permanently_on_the_misconfiguration_naming_the_field(judge, tmp_path):
    """The trainer's generation gets the 422 and exits with EXIT_CONFIG (no gang restart can fix it),
    the message naming spec.reward.model.prompt in its log."""
    _, rollout, policy = judge
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n" for i in range(8))
    )
    port = int(rollout.rsplit(":", 1)[1])
    contract = trainer_run.write_contract(tmp_path, policy, port, dataset=str(data), maxSteps=2)
    proc = trainer_run.start_trainer(contract, tmp_path)
    assert trainer_run.finish(proc, tmp_path, timeout=180) == EXIT_CONFIG, trainer_run.log_tail(tmp_path)
    log = (tmp_path / "trainer.log").read_text()
    assert "reward_misconfigured" in log and "spec.reward.model.prompt names {answer}" in log
    # the termination message the operator fails the job with: its stated reason, then the field
    assert "RewardModelMisconfigured: " in log
