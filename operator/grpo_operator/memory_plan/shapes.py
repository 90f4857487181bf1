"""A MoE model's shape from its Hugging Face `config.json`: exact parameter counts by category.

Read by `grpo_operator.memory_plan` (the plan) for every architecture the trainer's
`expert_parallel` supports: Qwen3-MoE, Qwen2-MoE, Mixtral and DeepSeek-V3 (MLA attention, shared
experts, `first_k_dense_replace` dense layers). Counts follow the transformers modules parameter
by parameter (tests/unit/test_memory_plan_shapes.py holds them to `numel` of tiny real models);
buffers such as DeepSeek-V3's `e_score_correction_bias` are not parameters and are not counted.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")


class UnsupportedModel(ValueError):
    """A config.json the plan cannot read (unknown model_type or a missing field)."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model. Counts are parameters (elements), not bytes."""

    model_type: str
    layers: int
    moe_layers: int
    hidden: int
    vocab: int
    experts: int  # routed experts per MoE layer
    top_k: int
    expert_params: int  # one routed expert (gate, up, down)
    embed: int  # input embeddings
    lm_head: int  # 0 when tied to the embeddings
    attention: int  # all layers: projections, their norms and biases
    norms: int  # all layers' input/post-attention norms and the final norm
    router: int  # all MoE layers' gates
    shared_experts: int  # all MoE layers' shared experts (and Qwen2-MoE's shared-expert gate)
    dense_mlp: int  # all dense (non-MoE) layers' MLPs
    # per token, for activations
    q_dim: int  # attention query width (heads x query head dim)
    kv_dim: int  # key + value width per token in the training forward (after MLA's expansion)
    attn_out: int  # input width of o_proj
    latent: int  # MLA low-rank widths per token (q_lora + kv_lora + rope), 0 otherwise
    moe_intermediate: int
    shared_intermediate: int  # per MoE layer, 0 without shared experts
    dense_intermediate: int
    # per token, for the rollout's KV cache
    kv_heads: int  # KV heads (0 for MLA, whose cache is one latent per token)
    head_dim: int
    mla_cache: int  # kv_lora_rank + qk_rope_head_dim for MLA, else 0
    max_positions: int

    @property
    def expert_total(self) -> int:
        return self.moe_layers * self.experts * self.expert_params

    @property
    def dense_total(self) -> int:
        """Every parameter that is not a routed expert: replicated (or FSDP-sharded) over the world."""
        return (
            self.embed
            + self.lm_head
            + self.attention
            + self.norms
            + self.router
            + self.shared_experts
            + self.dense_mlp
        )

    @property
    def total(self) -> int:
        return self.dense_total + self.expert_total

    def categories(self) -> dict[str, int]:
        return {
            "embed": self.embed,
            "lm_head": self.lm_head,
            "attention": self.attention,
            "norms": self.norms,
            "router": self.router,
            "shared_experts": self.shared_experts,
            "dense_mlp": self.dense_mlp,
            "experts": self.expert_total,
        }

    def layer_params(self, expert_shards: int) -> int:
        """The largest decoder layer's parameters on one rank with experts split `expert_shards` ways."""
        attn = self.attention // self.layers
        moe = (self.router + self.shared_experts) // max(self.moe_layers, 1)
        moe += self.experts * self.expert_params // expert_shards
        dense = self.dense_mlp // max(self.layers - self.moe_layers, 1)
        return (
            attn
            + 2 * self.hidden
            + max(moe if self.moe_layers else 0, dense if self.moe_layers < self.layers else 0)
        )


def _need(config: Mapping[str, Any], key: str, *aliases: str) -> Any:
    """config[key], or its first alias present (transformers 5 writes num_experts as num_local_experts)."""
    for k in (key, *aliases):
        if config.get(k) is not None:
            return config[k]
    raise UnsupportedModel(f"config.json of {config.get('model_type')!r} lacks {key!r}")


def _mlp(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # gate, up, down; no biases in any supported architecture


def from_config(config: Mapping[str, Any]) -> ModelShape:
    """The shape of the model a transformers `config.json` describes."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type {kind!r} is not supported by the plan (supported: {', '.join(MODEL_TYPES)})"
        )
    h, n_layers, vocab = (
        _need(config, "hidden_size"),
        _need(config, "num_hidden_layers"),
        _need(config, "vocab_size"),
    )
    heads = _need(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    top_k = _need(config, "num_experts_per_tok")
    tied = bool(config.get("tie_word_embeddings", False))
    dense_i = config.get("intermediate_size") or 0
    shared_gate = 0
    latent = mla_cache = 0
    if kind == "deepseek_v3":
        experts, moe_i = (
            _need(config, "n_routed_experts", "num_local_experts"),
            _need(config, "moe_intermediate_size"),
        )
        moe_idx = [i for i in range(n_layers) if i >= config.get("first_k_dense_replace", 0)]
        shared_i = moe_i * (config.get("n_shared_experts") or 0)
        nope, rope, v_dim = (_need(config, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        q_lora, kv_lora = config.get("q_lora_rank"), _need(config, "kv_lora_rank")
        bias = bool(config.get("attention_bias", False))
        q_head = nope + rope
        # with q_lora: q_a_proj (+bias), q_a_layernorm, q_b_proj; else one q_proj
        q_low = h * q_lora + bias * q_lora + q_lora + q_lora * heads * q_head if q_lora else 0
        q = q_low or h * heads * q_head
        kv = h * (kv_lora + rope) + bias * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim)
        attn_layer = q + kv + heads * v_dim * h + bias * h
        q_dim, kv_dim, attn_out = heads * q_head, heads * (q_head + v_dim), heads * v_dim
        latent, mla_cache = (q_lora or 0) + kv_lora + rope, kv_lora + rope
        head_dim, kv_heads = q_head, 0
    else:
        head_dim = config.get("head_dim") or h // heads
        q_dim, kv_w = heads * head_dim, kv_heads * head_dim
        if kind == "qwen3_moe":
            bias = bool(config.get("attention_bias", False))
            attn_layer = 2 * h * q_dim + 2 * h * kv_w + bias * (q_dim + 2 * kv_w + h) + 2 * head_dim
        elif kind == "qwen2_moe":
            bias = bool(config.get("qkv_bias", True))
            attn_layer = 2 * h * q_dim + 2 * h * kv_w + bias * (q_dim + 2 * kv_w)
        else:  # mixtral
            attn_layer = 2 * h * q_dim + 2 * h * kv_w
        kv_dim, attn_out = 2 * kv_w, q_dim
        if kind == "mixtral":
            experts, moe_i, shared_i = _need(config, "num_local_experts", "num_experts"), dense_i, 0
            moe_idx = list(range(n_layers))
        else:
            experts, moe_i = (
                _need(config, "num_experts", "num_local_experts"),
                _need(config, "moe_intermediate_size"),
            )
            only, step = set(config.get("mlp_only_layers") or []), config.get("decoder_sparse_step", 1) or 1
            moe_idx = [i for i in range(n_layers) if i not in only and experts > 0 and (i + 1) % step == 0]
            shared_i = (config.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
            shared_gate = h if kind == "qwen2_moe" else 0
    n_moe = len(moe_idx)
    return ModelShape(
        model_type=kind,
        layers=n_layers,
        moe_layers=n_moe,
        hidden=h,
        vocab=vocab,
        experts=experts,
        top_k=top_k,
        expert_params=_mlp(h, moe_i),
        embed=vocab * h,
        lm_head=0 if tied else vocab * h,
        attention=n_layers * attn_layer,
        norms=2 * h * n_layers + h,
        router=n_moe * experts * h,
        shared_experts=n_moe * (_mlp(h, shared_i) + shared_gate),
        dense_mlp=(n_layers - n_moe) * _mlp(h, dense_i),
        q_dim=q_dim,
        kv_dim=kv_dim,
        attn_out=attn_out,
        latent=latent,
        moe_intermediate=moe_i,
        shared_intermediate=shared_i,
        dense_intermediate=dense_i,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mla_cache=mla_cache,
        max_positions=config.get("max_position_embeddings") or 0,
    )
