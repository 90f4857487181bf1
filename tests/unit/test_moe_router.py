"""The router reproduces the HF routers it replaces, replays given choices and scores balance."""

from __future__ import annotations

import pytest
import torch
from grpo_trainer.moe import MoELayer, Router, RouterConfig, load_balancing_loss, make_dispatcher
from grpo_trainer.moe.experts import GroupedExperts
from grpo_trainer.moe.layer import recorded_routing, set_routing_replay


def sorted_choice(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot order is not part of a routing decision: sort each token's slots by expert id."""
    idx_sorted, order = idx.sort(dim=1)
    return weights.gather(1, order), idx_sorted


def test_softmax_router_matches_qwen3_moe_router() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
    hf = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(hf.weight)
    ours = Router(RouterConfig(num_experts=8, top_k=3, norm_topk_prob=True), 16, weight=hf.weight)
    x = torch.randn(40, 16)
    hf_logits, hf_weights, hf_idx = hf(x)
    logits, weights, idx = ours(x)
    torch.testing.assert_close(logits, hf_logits)
    for a, b in zip(sorted_choice(weights, idx), sorted_choice(hf_weights, hf_idx), strict=True):
        torch.testing.assert_close(a, b)


def test_group_limited_sigmoid_router_matches_deepseek_v3_router() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    hf = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(hf.weight)
    hf.e_score_correction_bias.uniform_(-0.3, 0.3)
    cfg = RouterConfig(
        num_experts=16, top_k=4, score_func="sigmoid", num_groups=4, topk_groups=2, scaling_factor=2.5,
        score_bias=True,
    )  # fmt: skip
    ours = Router(cfg, 16, weight=hf.weight)
    ours.e_score_correction_bias = hf.e_score_correction_bias
    x = torch.randn(64, 16)
    _, hf_weights, hf_idx = hf(x)
    _, weights, idx = ours(x)
    for a, b in zip(sorted_choice(weights, idx), sorted_choice(hf_weights, hf_idx), strict=True):
        torch.testing.assert_close(a, b)
    groups = idx // 4  # every token's experts come from at most topk_groups groups
    assert max(len(set(row.tolist())) for row in groups) <= 2


def test_replayed_choice_keeps_weights_differentiable() -> None:
    router = Router(RouterConfig(num_experts=6, top_k=2), 8)
    x = torch.randn(10, 8)
    _, weights, idx = router(x)
    _, replay_weights, replay_idx = router(x, given_idx=idx)
    torch.testing.assert_close(replay_weights, weights)
    assert torch.equal(replay_idx, idx)
    forced = torch.tensor([[0, 5]] * 10)
    _, forced_weights, forced_idx = router(x, given_idx=forced)
    assert torch.equal(forced_idx, forced)
    probs = torch.softmax(x @ router.weight.T, dim=-1)[:, [0, 5]]
    torch.testing.assert_close(forced_weights, probs / probs.sum(1, keepdim=True))
    forced_weights[:, 0].sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_layer_records_and_replays_routing() -> None:
    config = RouterConfig(num_experts=4, top_k=2)
    layer = MoELayer(
        Router(config, 8),
        GroupedExperts(torch.randn(4, 6, 8), torch.randn(4, 8, 3), num_experts=4),
        make_dispatcher("local", None, 4),
    )
    x = torch.randn(5, 8)
    out = layer(x)
    (recorded,) = recorded_routing(layer)
    set_routing_replay(layer, [recorded])
    torch.testing.assert_close(layer(x), out)
    set_routing_replay(layer, [torch.zeros(5, 2, dtype=torch.long) + torch.tensor([1, 3])])
    assert not torch.allclose(layer(x), out)
    set_routing_replay(layer, None)
    assert layer.replay_idx is None
    with pytest.raises(ValueError):
        set_routing_replay(layer, [recorded, recorded])


def test_balancing_loss_is_one_when_uniform_and_grows_when_concentrated() -> None:
    probs = torch.full((8, 4), 0.25)
    spread = torch.tensor([[0, 1], [2, 3]] * 4)
    torch.testing.assert_close(load_balancing_loss(probs, spread, 4), torch.tensor(1.0))
    peaked = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 8)
    assert load_balancing_loss(peaked, torch.tensor([[0, 1]] * 8), 4) > 1.5
    router = Router(RouterConfig(num_experts=4, top_k=2, aux_loss_coef=0.01), 8).train()
    router(torch.randn(6, 8))
    assert router.aux_loss is not None and router.aux_loss.requires_grad


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_experts=4, top_k=5),
        dict(num_experts=6, top_k=2, num_groups=4),
        dict(num_experts=8, top_k=2, num_groups=4, topk_groups=5),
        dict(num_experts=8, top_k=2, aux_loss_coef=-1.0),
    ],
)
def test_invalid_router_configs_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RouterConfig(**kwargs)


def test_expert_parallel_turns_hf_router_logits_into_its_own_balancing_loss() -> None:
    from grpo_trainer.moe import expert_parallel, moe_aux_loss
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="output_router_logits"):
        expert_parallel(Qwen3MoeForCausalLM(config))
    config.output_router_logits = False
    model = expert_parallel(Qwen3MoeForCausalLM(config), aux_loss_coef=0.01).train()
    model(torch.randint(0, 32, (1, 6)))
    loss = moe_aux_loss(model)
    assert loss is not None and 0.02 <= float(loss.detach()) < 0.04  # two layers, each >= 0.01 * 1


def test_unrecorded_replay_slots_spread_over_all_experts() -> None:
    """Padding (-1 from batch.replay_routing) must not all land on experts 0..k-1 (EP rank 0)."""
    from grpo_trainer.batch import replay_routing
    from grpo_trainer.moe.router import spread_unrecorded

    routes = [torch.tensor([[[1, 2]], [[3, 4]]], dtype=torch.uint8)]  # 2 recorded tokens, 1 layer, k=2
    (given,) = replay_routing(routes, width=32)  # 30 unrecorded positions
    assert given[:2].tolist() == [[1, 2], [3, 4]] and (given[2:] == -1).all()
    idx = spread_unrecorded(given, num_experts=8)
    assert idx[:2].tolist() == [[1, 2], [3, 4]]
    assert all(len(set(row)) == 2 for row in idx.tolist())  # k distinct experts per token
    load = torch.bincount(idx[2:].reshape(-1), minlength=8)  # 60 padding slots over 8 experts
    assert load.min() == 7 and load.max() == 8
    router = Router(RouterConfig(num_experts=8, top_k=2), 4)
    _, weights, replayed = router(torch.randn(32, 4), given_idx=given)
    assert torch.equal(replayed, idx) and torch.isfinite(weights).all()
