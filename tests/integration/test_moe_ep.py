"""Expert parallelism over real gloo process groups matches the unsharded model exactly (fp32).

Each world size (1, 2, 4) is one spawn of real processes that runs every check below, so
torch and transformers are imported once per world. Every rank has its own batch; the
reference is the unsharded model run on the same batches inside each process:
- logits and every non-expert gradient match the reference on the rank's own batch;
- each local expert's gradient matches the sum over all ranks of its reference gradients.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import start_ranks

ATOL, RTOL = 2e-5, 1e-4


def tiny_models() -> dict[str, torch.nn.Module]:
    """One tiny random model per supported architecture (same weights on every rank)."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    base = dict(
        vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        initializer_range=0.1, attn_implementation="eager",
    )  # fmt: skip
    configs = {
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **base, head_dim=16, intermediate_size=32, moe_intermediate_size=16, num_experts=8,
            num_experts_per_tok=3, norm_topk_prob=True,
        )),
        "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
            **base, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        )),
        "mixtral": (MixtralForCausalLM, MixtralConfig(
            **base, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
        )),
        "deepseek_v3": (DeepseekV3ForCausalLM, DeepseekV3Config(
            **{**base, "num_key_value_heads": 2}, intermediate_size=32, moe_intermediate_size=16,
            n_routed_experts=8, num_experts_per_tok=3,
            n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
            kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        )),
    }  # fmt: skip
    models = {}
    for name, (cls, config) in configs.items():
        torch.manual_seed(0)
        model = cls(config).float()
        for module in model.modules():  # a non-trivial correction bias exercises choice vs weight
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.uniform_(-0.05, 0.05)
        models[name] = model
    return models


def batch(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s input ids and a fixed projection of its logits (the loss)."""
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, vocab, (2, 5 + rank), generator=gen)
    return ids, torch.randn(2, 5 + rank, vocab, generator=gen)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def check_model(name: str, reference: torch.nn.Module, rank: int, world: int, backend: str) -> None:
    from grpo_trainer import moe

    vocab = reference.config.vocab_size
    model = moe.expert_parallel(copy.deepcopy(reference), backend=backend)
    assert len(moe.moe_layers(model)) >= 1
    assert moe.exchange_seconds(model) == 0.0  # auto's start-up measurement is not training time
    ids, proj = batch(rank, vocab)
    logits = model(ids).logits
    (logits * proj).sum().backward()
    # forward and backward exchanges are timed at EP > 1; nothing leaves the rank at EP = 1
    assert (moe.exchange_seconds(model) > 0) == (world > 1)
    assert moe.exchange_seconds(model) == 0.0  # taken: the next step starts from zero

    ref_logits = reference(ids).logits
    (ref_logits * proj).sum().backward()
    assert_close(logits, ref_logits, f"{name} logits")
    params = dict(model.named_parameters())
    own = {n: p.grad.clone() for n, p in reference.named_parameters()}
    reference.zero_grad()
    for other in range(world):  # expert gradients: every rank's tokens reach the expert's owner
        other_ids, other_proj = batch(other, vocab)
        (reference(other_ids).logits * other_proj).sum().backward()
    for pname, ref_param in reference.named_parameters():
        if pname.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer = model.get_submodule(pname.rsplit(".experts.", 1)[0])
            lo, n = layer.experts.first_expert, layer.experts.num_local_experts
            assert params[pname].shape[0] == n == ref_param.shape[0] // world
            assert_close(params[pname].grad, ref_param.grad[lo : lo + n], f"{name} {pname} grad")
        else:
            assert_close(params[pname].grad, own[pname], f"{name} {pname} grad")
    reference.zero_grad()


def check_layer_edge_cases(rank: int, world: int) -> None:
    """Forced routing: empty experts, one expert for all, top-k slots on one rank, a rank without tokens."""
    from grpo_trainer import moe

    hidden, inter, experts = 16, 8, 8
    torch.manual_seed(1)
    gate_up, down = torch.randn(experts, 2 * inter, hidden) * 0.3, torch.randn(experts, hidden, inter) * 0.3
    router_weight = torch.randn(experts, hidden)
    cases = {
        # name: (top_k, tokens of rank r, routing of rank r)
        "empty_experts_and_same_rank_slots": (
            3,
            lambda r: 6 + r,
            lambda t: torch.tensor([0, 1, 5]).repeat(t, 1),
        ),
        "all_to_one_expert": (1, lambda r: 7, lambda t: torch.full((t, 1), experts - 1)),
        "rank_without_tokens": (
            2,
            lambda r: 0 if r == world - 1 else 4 + r,
            lambda t: torch.randint(0, 8, (t, 2)),
        ),
    }
    group = dist.group.WORLD
    for case, (top_k, tokens, routing) in cases.items():
        config = moe.RouterConfig(num_experts=experts, top_k=top_k, norm_topk_prob=False)

        def layer(ep_group, n_shards, shard, config=config):
            lo, n = shard * experts // n_shards, experts // n_shards
            return moe.MoELayer(
                moe.Router(config, hidden, torch.nn.Parameter(router_weight.clone())),
                moe.GroupedExperts(
                    gate_up[lo : lo + n].clone(), down[lo : lo + n].clone(), experts, lo, ep_group
                ),
                moe.make_dispatcher("gloo" if ep_group else "local", ep_group, experts),
            )

        ep, ref = layer(group, world, rank), layer(None, 1, 0)
        inputs = []
        for r in range(world):
            torch.manual_seed(10 + r)
            idx = routing(tokens(r))
            inputs.append((torch.randn(tokens(r), hidden, requires_grad=True), idx[torch.randperm(len(idx))]))
        x, idx = inputs[rank]
        ep.replay_idx = idx
        out = ep(x)
        out.pow(2).sum().backward()
        ref_x = x.detach().clone().requires_grad_(True)
        ref.replay_idx = idx
        ref_out = ref(ref_x)
        ref_out.pow(2).sum().backward()
        assert_close(out, ref_out, case)
        assert_close(x.grad, ref_x.grad, f"{case} input grad")
        assert_close(ep.gate.weight.grad, ref.gate.weight.grad, f"{case} router grad")
        ref.zero_grad()
        for other_x, other_idx in inputs:
            ref.replay_idx = other_idx
            ref(other_x.detach()).pow(2).sum().backward()
        lo, n = ep.experts.first_expert, ep.experts.num_local_experts
        assert_close(
            ep.experts.gate_up_proj.grad, ref.experts.gate_up_proj.grad[lo : lo + n], f"{case} experts"
        )
        assert_close(ep.experts.down_proj.grad, ref.experts.down_proj.grad[lo : lo + n], f"{case} experts")


def check_checkpoint(reference: torch.nn.Module, rank: int, world: int, folder: str) -> None:
    """Load reads the local experts from save_pretrained output; full_state_dict restores the whole,
    and `save_pretrained(state_dict=full_state_dict(model))` writes a checkpoint HF reloads."""
    from grpo_trainer import moe

    if rank == 0:
        reference.save_pretrained(folder)
    dist.barrier()
    fresh = copy.deepcopy(reference)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    model = moe.expert_parallel(fresh, backend="gloo")
    moe.load_checkpoint(model, folder)
    full = moe.full_state_dict(model)
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(full[key], tensor, atol=0, rtol=0, msg=key)
    if rank == 0:
        model.save_pretrained(os.path.join(folder, "resaved"), state_dict=full)
        reloaded = type(reference).from_pretrained(os.path.join(folder, "resaved")).state_dict()
        for key, tensor in expected.items():
            torch.testing.assert_close(reloaded[key], tensor, atol=0, rtol=0, msg=f"resaved {key}")
    dist.barrier()


def check_auto(rank: int, world: int) -> None:
    from grpo_trainer import moe

    dispatcher = moe.make_dispatcher("auto", dist.group.WORLD if world > 1 else None, 8)
    assert dispatcher.name == ("local" if world == 1 else "gloo")
    if world > 1:
        assert dispatcher.selection.backend == "gloo"
        assert dispatcher.selection.seconds["gloo"] > 0


def worker(rank: int, world: int, store: str, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        models = tiny_models()
        for name, reference in models.items():
            check_model(name, reference, rank, world, backend="auto")
        check_layer_edge_cases(rank, world)
        check_checkpoint(models["mixtral"], rank, world, os.path.join(folder, "mixtral"))
        check_checkpoint(models["deepseek_v3"], rank, world, os.path.join(folder, "deepseek_v3"))
        check_auto(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_expert_parallel_matches_unsharded_reference(world: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        start_ranks(worker, (world, os.path.join(folder, "store"), folder), world)
