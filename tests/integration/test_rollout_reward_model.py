"""A rollout server scoring with a reward model, over real HTTP: `python -m grpo_rollout serve` (torch
engine, tiny policy) whose contract has spec.reward.model (the tiny classifier) and contract.reward's
endpoint, a `python -m grpo_rollout reward` child. Each completion carries the model's RewardDetail
beside the functions', its score the classifier's own for that prompt and completion, and the reward
adds weight x score.
"""

import asyncio

import pytest
from grpo_wire.client import RolloutClient
from grpo_wire.protocol import Prompt, Sampling

from tests.support.ports import free_port
from tests.support.reward import (
    build_reward_classifier,
    metric,
    score,
    start_reward_server,
    write_reward_contract,
)
from tests.support.rollout import build_tiny_model, start_server, stop_server, wait_ready

pytestmark = pytest.mark.slow
TOKEN = "job-token"
WEIGHT = 2.5


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout-rm")
    policy = build_tiny_model(tmp / "policy", arch="qwen3_moe")
    classifier = build_reward_classifier(tmp / "rm")
    reward_port, rollout_port = free_port(), free_port()
    contract = write_reward_contract(
        tmp / "job.json",
        policy,
        {"path": str(classifier), "weight": WEIGHT, "batchSize": 3, "timeoutSeconds": 20},
        reward_ports=[reward_port],
        rollout_ports=[rollout_port],
        functions=[{"builtin": "exact_match", "weight": 0.5}],
    )
    procs = [
        start_reward_server(contract, 0, TOKEN, log_path=tmp / "reward.log"),
        start_server(contract, rollout_port, TOKEN, log_path=tmp / "rollout.log"),
    ]
    urls = [f"http://127.0.0.1:{reward_port}", f"http://127.0.0.1:{rollout_port}"]
    try:
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        yield urls[0], urls[1]
    finally:
        for proc in procs:
            stop_server(proc)


def test_completions_carry_the_models_detail_and_the_reward_adds_weight_times_score(servers):
    reward_url, rollout_url = servers
    prompts = [
        Prompt(id="a", text="1+1=", columns={"answer": "2"}),
        Prompt(id="b", text="3+4=", columns={"answer": "7"}),
    ]

    async def go():
        async with RolloutClient([rollout_url], TOKEN) as client:
            return await client.generate(
                prompts, n=4, sampling=Sampling(temperature=1.0, max_new_tokens=8, seed=3)
            )

    results = asyncio.run(go())
    completions = [(p, c) for p, r in zip(prompts, results, strict=True) for c in r.completions]
    assert len(completions) == 8
    for _, c in completions:
        details = {d.name: d for d in c.reward_details}
        assert set(details) == {"exact_match", "model"}
        model = details["model"]
        assert model.weight == WEIGHT and model.error is None
        assert c.reward == pytest.approx(0.5 * details["exact_match"].score + WEIGHT * model.score)
    # the detail is the classifier's own score of that prompt and completion
    items = [{"prompt": p.text, "completion": c.text} for p, c in completions]
    status, direct = score(reward_url, items, TOKEN)
    assert status == 200
    got = [next(d.score for d in c.reward_details if d.name == "model") for _, c in completions]
    assert got == pytest.approx(direct["scores"], abs=1e-4)
    assert len(set(round(s, 6) for s in got)) > 1  # different completions, different scores
    assert metric(reward_url, "grpo_reward_items_scored_total") == 16  # 8 from /generate, 8 direct
