"""The policy learns from a reward model's scores, through the real path: a tiny classifier trained in
this test to prefer completions containing one character (TARGET) is served by `python -m grpo_rollout
reward`; a rollout server (torch engine, the warmed tiny policy) scores with it; `python -m grpo_trainer
train` runs GRPO steps against them. The share of sampled completions containing TARGET rises.

The classifier learns the property on synthetic completions first (checked: it separates held-out
ones), so what the test measures is the policy moving toward what the reward model prefers.
"""

import asyncio
import random
from pathlib import Path

import pytest
import torch
from grpo_operator.api.contract import RewardTopology, RunContract
from grpo_operator.api.spec import RewardModelSpec
from grpo_trainer.tiny_model import TinyConfig, build_reward_classifier, build_tokenizer
from grpo_wire.client import RolloutClient
from grpo_wire.protocol import Prompt, Sampling

from tests.support import trainer_run as gang
from tests.support.ports import free_port
from tests.support.reward import start_reward_server
from tests.support.rollout import start_server, stop_server, wait_ready
from tests.support.trainer_run import TOKEN, finish, log_tail, progress, start_trainer, write_contract

pytestmark = pytest.mark.slow
tiny = gang.tiny  # the warmed tiny policy (answers single-digit sums, ~30% right)
TARGET = "9"  # in ~12% of the warmed policy's sampled answers: room to rise, signal in most groups
STEPS = 5


def train_classifier(out: Path, steps: int = 80, seed: int = 0) -> float:
    """A tiny reward classifier whose logit says whether the answer contains TARGET, trained on
    synthetic sums and answers through the chat template the server applies; saved to `out`.
    Returns its accuracy on fresh examples."""
    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = build_reward_classifier(TinyConfig(hidden=32, layers=1, max_positions=128, seed=seed), tok)
    rng = random.Random(seed)
    chars = "0123456789" * 3 + "abk+="  # mostly digits, like the policy's answers

    def batch(size: int) -> tuple[dict, torch.Tensor]:
        texts, labels = [], []
        for _ in range(size):
            answer = "".join(rng.choice(chars) for _ in range(rng.choice([1, 2, 2, 3])))
            chat = [
                {"role": "user", "content": f"{rng.randrange(10)}+{rng.randrange(10)}="},
                {"role": "assistant", "content": answer},
            ]
            texts.append(tok.apply_chat_template(chat, tokenize=False))
            labels.append(float(TARGET in answer))
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc, torch.tensor(labels)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        enc, y = batch(48)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(**enc).logits[:, 0], y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    enc, y = batch(400)
    with torch.no_grad():
        accuracy = ((model(**enc).logits[:, 0] > 0).float() == y).float().mean().item()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return accuracy


def target_share(url: str, seed: int) -> float:
    """Share of 4 sampled answers per sum (all 100) that contain TARGET, at temperature 1."""
    prompts = [Prompt(id=f"{a}{b}", text=f"{a}+{b}=") for a in range(10) for b in range(10)]

    async def go():
        async with RolloutClient([url], TOKEN) as client:
            sampling = Sampling(temperature=1.0, max_new_tokens=3, seed=seed)
            return await client.generate(prompts, n=4, sampling=sampling)

    texts = [c.text for r in asyncio.run(go()) for c in r.completions]
    return sum(TARGET in t for t in texts) / len(texts)


def test_the_policy_rises_in_what_the_reward_model_prefers(tiny: Path, tmp_path: Path) -> None:
    classifier = tmp_path / "rm"
    assert train_classifier(classifier) > 0.95
    rollout_port, reward_port = free_port(), free_port()
    path = write_contract(
        tmp_path, tiny, rollout_port, maxSteps=STEPS, groupSize=8, promptsPerStep=8, microBatchSize=8,
        maxNewTokens=3, learningRate=3e-3, maxStaleness=0, checkpoint_every=100,
    )  # fmt: skip
    contract = RunContract.model_validate_json(path.read_text())
    contract.spec.reward.functions = []  # the reward model alone scores
    contract.spec.reward.model = RewardModelSpec(path=str(classifier), batchSize=32, timeoutSeconds=30)
    contract.reward = RewardTopology(
        service="t-reward", replicas=1, port=reward_port, endpoints=[f"http://127.0.0.1:{reward_port}"]
    )
    path.write_text(contract.model_dump_json(by_alias=True))
    procs = [
        start_reward_server(path, 0, TOKEN, log_path=tmp_path / "reward.log"),
        start_server(path, rollout_port, TOKEN, log_path=tmp_path / "rollout.log"),
    ]
    url = f"http://127.0.0.1:{rollout_port}"
    try:
        wait_ready(f"http://127.0.0.1:{reward_port}", procs[0])
        wait_ready(url, procs[1])
        before = target_share(url, seed=11)
        assert finish(start_trainer(path, tmp_path), tmp_path, timeout=400) == 0, log_tail(tmp_path)
        steps = progress(tmp_path)
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        after = target_share(url, seed=11)  # the server holds the trained policy now
    finally:
        for proc in procs:
            stop_server(proc)
    rewards = [round(r["reward_mean"], 2) for r in steps]
    print(f"share of answers with {TARGET!r}: {before:.3f} -> {after:.3f}; reward_mean by step {rewards}")
    assert after > before + 0.25, (before, after, rewards)
