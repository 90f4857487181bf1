"""Shrunk configs of each MoE architecture the trainer supports, built with transformers: real
parameter counts and names, in milliseconds (memory plan shapes, export plan)."""

from transformers import (
    DeepseekV3Config,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

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
