"""`memory_plan.shapes`: parameter counts from config.json, exact against real (tiny) HF models.

Each architecture `expert_parallel` supports is built from a shrunk config with transformers and
its `numel` counted by category (routed experts vs everything else); the formula must match to
the parameter. The full-size public configs (tests/data/model-configs) give the published totals.
"""

import json
from pathlib import Path

import pytest
from grpo_operator.memory_plan import UnsupportedModel, from_config
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model-configs"
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=100)
TINY = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=32, num_hidden_layers=4, num_key_value_heads=2, head_dim=24,
        num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], attention_bias=True,
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SMALL, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2,
    ),
    "mixtral": lambda: MixtralConfig(
        **SMALL, num_hidden_layers=3, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    "mixtral_tied": lambda: MixtralConfig(
        **SMALL, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=True,
    ),
    "deepseek_v3": lambda: DeepseekV3Config(
        **SMALL, moe_intermediate_size=32, num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    ),
    "deepseek_v3_no_q_lora": lambda: DeepseekV3Config(
        **SMALL, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=2, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    ),
}  # fmt: skip


def counted(config) -> tuple[int, int]:
    """(dense, routed-expert) parameters of the real model."""
    model = AutoModelForCausalLM.from_config(config)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return sum(p.numel() for p in model.parameters()) - expert, expert


@pytest.mark.parametrize("name", sorted(TINY))
def test_counts_match_the_real_model_exactly(name):
    config = TINY[name]()
    shape = from_config(config.to_dict())
    assert (shape.dense_total, shape.expert_total) == counted(config)
    assert shape.total == sum(shape.categories().values())


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.config.json").read_text())


def test_published_sizes():
    qwen = from_config(load("qwen3-30b-a3b"))
    assert qwen.total == 30_532_122_624  # "30.5 B"
    assert qwen.expert_total == 28_991_029_248 and qwen.dense_total == 1_541_093_376
    assert (qwen.layers, qwen.moe_layers, qwen.experts, qwen.top_k) == (48, 48, 128, 8)
    ds = from_config(load("deepseek-v3"))
    assert round(ds.total / 1e9) == 671  # without the MTP layer, which transformers does not build
    assert ds.moe_layers == 58 and ds.mla_cache == 576 and ds.kv_heads == 0
    mixtral = from_config(load("mixtral-8x7b"))
    assert round(mixtral.total / 1e8) == 467  # "46.7 B"


def test_unknown_architectures_are_refused_by_name():
    with pytest.raises(UnsupportedModel, match="llama"):
        from_config({"model_type": "llama"})
    with pytest.raises(UnsupportedModel, match="moe_intermediate_size"):
        from_config({**load("qwen3-30b-a3b"), "moe_intermediate_size": None})
