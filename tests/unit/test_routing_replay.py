"""Routing replay end to end on one process: rollout engine → wire → batch layout → trainer forward.

The torch engine samples from a tiny Qwen3-MoE and records its routing; the completions cross the
wire protocol, become a micro-batch, and the trainer's expert-parallel copy of the same model
replays the recorded experts. With the rollout's own weights the trainer reproduces the engine's
log-probs; with perturbed router weights it routes differently on its own, and replay forces the
recorded experts back.
"""

import pytest
import torch
from grpo_rollout.engines.base import EngineConfig, create_engine
from grpo_trainer import moe
from grpo_trainer.batch import Rollouts, micro_batches
from grpo_trainer.forward import forward_logp
from grpo_wire.protocol import Completion, PromptResult, Sampling
from transformers import AutoModelForCausalLM

from tests.support.rollout import build_tiny_model

PROMPTS = ["1+1=", "what is 12 * 7?", "hello world, how are you"]
GROUP = 2
SAMPLING = Sampling(temperature=1.2, max_new_tokens=10, seed=7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe")


@pytest.fixture(scope="module")
def batch(model_dir):
    """One micro-batch of every completion, routing included, as the trainer builds it."""
    engine = create_engine("torch", EngineConfig(model_path=str(model_dir), max_batch_size=4))
    results = []
    for i, ps in enumerate(engine.generate(PROMPTS, GROUP, SAMPLING, lambda: False, routing=True)):
        completions = [
            Completion(text=s.text, token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason,
                       reward=0.0, routing=s.routing)
            for s in ps.samples
        ]  # fmt: skip
        wire = PromptResult(prompt_id=str(i), prompt_token_ids=ps.prompt_token_ids, completions=completions)
        results.append(PromptResult.model_validate_json(wire.model_dump_json()))
    rollouts = Rollouts.from_results(results, GROUP, weight_version=0, routing=True)
    everything = list(range(len(rollouts)))
    (mb,) = micro_batches(rollouts, [everything], torch.zeros(len(rollouts)), pad_id=0)
    return rollouts, mb


def trainer_policy(model_dir, router_noise: float = 0.0) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    moe.expert_parallel(model, backend="local")
    with torch.no_grad():
        for layer in moe.moe_layers(model):
            layer.gate.weight.add_(router_noise * torch.randn_like(layer.gate.weight))
    return model


def real_tokens(rollouts: Rollouts, width: int) -> torch.Tensor:
    """[b * L] True where a token was fed through the rollout model (prompt + completion - 1)."""
    keep = torch.zeros(len(rollouts), width, dtype=torch.bool)
    for row, r in enumerate(rollouts.routing or []):
        keep[row, : len(r)] = True
    return keep.flatten()


def sorted_experts(idx: list[torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    """[layers, tokens, k] with each token's slots sorted: slot order is no part of a choice."""
    return torch.stack([t[keep].long().sort(-1).values for t in idx])


def test_replay_with_the_rollout_weights_reproduces_the_engine_logprobs(model_dir, batch) -> None:
    rollouts, mb = batch
    model = trainer_policy(model_dir)
    keep = real_tokens(rollouts, mb.input_ids.shape[1])
    with torch.no_grad():
        free, _ = forward_logp(model, mb.input_ids, SAMPLING.temperature)
        own_choice = moe.recorded_routing(model)
        with moe.replaying(model, mb.routing):
            replayed, _ = forward_logp(model, mb.input_ids, SAMPLING.temperature)
    # the batch layout puts every recorded choice on the very token the engine routed it for
    assert torch.equal(sorted_experts(own_choice, keep), sorted_experts(mb.routing, keep))
    real = mb.mask.bool()
    torch.testing.assert_close(replayed[real], mb.rollout_logp[real], atol=1e-4, rtol=0)
    torch.testing.assert_close(free[real], replayed[real], atol=1e-5, rtol=0)
    assert all(layer.replay_idx is None for layer in moe.moe_layers(model))  # cleared after the block


def test_replay_forces_the_recorded_experts_on_a_policy_that_routes_differently(model_dir, batch) -> None:
    rollouts, mb = batch
    torch.manual_seed(0)
    model = trainer_policy(model_dir, router_noise=0.5)
    keep = real_tokens(rollouts, mb.input_ids.shape[1])
    recorded = sorted_experts(mb.routing, keep)
    with torch.no_grad():
        free, _ = forward_logp(model, mb.input_ids, SAMPLING.temperature)
        assert not torch.equal(sorted_experts(moe.recorded_routing(model), keep), recorded)
    with moe.replaying(model, mb.routing):
        replayed, _ = forward_logp(model, mb.input_ids, SAMPLING.temperature)
    assert torch.equal(sorted_experts(moe.recorded_routing(model), keep), recorded)
    real = mb.mask.bool()
    assert not torch.allclose(free[real], replayed[real], atol=1e-4)  # the forced experts changed the outputs
    replayed[real].sum().backward()
    assert all(
        layer.gate.weight.grad.abs().sum() > 0 for layer in moe.moe_layers(model)
    )  # weights stay trainable
