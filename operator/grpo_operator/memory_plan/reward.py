"""Per-GPU memory of one reward model server (spec.reward.model): weights, runtime and, for a judge, its
KV cache, on each of the tensorParallelSize GPUs the renderer gives a reward pod.

Called through `memory_plan.plan_reward` by `grpo-operator plan`. The server (`grpo_rollout reward`)
loads the whole model with transformers on one device in spec.model.dtype and scores `batchSize`
completions per forward: a classifier reads one logit per sequence of prompt + completion tokens; a
generative judge also writes up to `maxNewTokens` tokens, keeping an HF KV cache for the whole batch.
With engine vllm the weights, activations and KV cache split over tensorParallelSize GPUs, and vLLM
claims 0.9 of each GPU (its default gpu_memory_utilization), filling what is left with KV cache.
Reward models are mostly dense decoders (Qwen2/Qwen3/Llama with a one-output head): `shape` reads
those from their config.json too, the MoE types through `shapes.from_config`.
"""

from collections.abc import Mapping
from typing import Any

from grpo_operator.api.spec import GRPOJobSpec, RewardModelEngine, RewardModelKind
from grpo_operator.memory_plan.inputs import DEFAULT_PROMPT_TOKENS, DTYPE_BYTES, GIB
from grpo_operator.memory_plan.result import Part, RolePlan
from grpo_operator.memory_plan.shapes import MODEL_TYPES, ModelShape, UnsupportedModel, from_config

RUNTIME_BYTES = 2 * GIB  # CUDA context and the allocator's slack
ACTIVATION_WIDTHS = 4  # hidden-sized activations alive at once per token in a no-grad forward


def shape(config: Mapping[str, Any]) -> ModelShape:
    """The reward model's shape: an MoE type the plan knows, else a dense decoder (every layer one
    attention and one gated MLP; a sequence classifier's head is hidden x labels instead of an LM head)."""
    if config.get("model_type") in MODEL_TYPES:
        return from_config(config)
    try:
        h, layers, vocab = (int(config[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
        heads, inter = int(config["num_attention_heads"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModel(
            f"config.json of {config.get('model_type')!r} is not a decoder the plan reads: {e}"
        ) from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    q_dim, kv_w = heads * head_dim, kv_heads * head_dim
    attn = 2 * h * q_dim + 2 * h * kv_w + (q_dim + 2 * kv_w if config.get("model_type") == "qwen2" else 0)
    classifier = any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])
    labels = len(config.get("id2label") or {}) or 1
    head = h * labels if classifier else (0 if config.get("tie_word_embeddings") else vocab * h)
    return ModelShape(
        model_type=str(config.get("model_type")),
        layers=layers,
        moe_layers=0,
        hidden=h,
        vocab=labels if classifier else vocab,
        experts=0,
        top_k=0,
        expert_params=0,
        embed=vocab * h,
        lm_head=head,
        attention=layers * attn,
        norms=2 * h * layers + h,
        router=0,
        shared_experts=0,
        dense_mlp=layers * 3 * h * inter,
        q_dim=q_dim,
        kv_dim=2 * kv_w,
        attn_out=q_dim,
        latent=0,
        moe_intermediate=0,
        shared_intermediate=0,
        dense_intermediate=inter,
        kv_heads=kv_heads,
        head_dim=head_dim,
        mla_cache=0,
        max_positions=int(config.get("max_position_embeddings") or 0),
    )


def plan(
    model_shape: ModelShape,
    spec: GRPOJobSpec,
    gpu_bytes: int | None,
    *,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> RolePlan:
    """The reward model of `model_shape` as `spec.reward.model` serves it, against one GPU of `gpu_bytes`."""
    model = spec.reward.model
    if model is None:
        raise ValueError("spec.reward.model is unset: no reward role to plan")
    w = DTYPE_BYTES[str(spec.model.dtype)]
    judge = model.kind == RewardModelKind.GENERATIVE
    tokens = prompt_tokens + spec.algorithm.max_new_tokens + (model.max_new_tokens if judge else 0)
    batch = model.batch_size
    tp = model.tensor_parallel_size if model.engine == RewardModelEngine.VLLM else 1
    split = f" / tensorParallelSize {tp}" if tp > 1 else ""
    parts = {
        "weights": Part(
            model_shape.total * w // tp,
            f"all parameters x {w} B (spec.model.dtype){split or ', on one GPU'}",
        ),
        "activations": Part(
            batch * tokens * model_shape.hidden * ACTIVATION_WIDTHS * w // tp,
            f"batchSize {batch} x {tokens} tokens x hidden {model_shape.hidden} x "
            f"{ACTIVATION_WIDTHS} x {w} B{split}",
        ),
        "runtime": Part(RUNTIME_BYTES, "2 GiB: CUDA context, allocator slack"),
    }
    if judge:
        parts["kv_cache"] = Part(
            batch * tokens * model_shape.layers * model_shape.kv_dim * w // tp,
            f"batchSize {batch} x {tokens} tokens x layers x (k + v width {model_shape.kv_dim}) x "
            f"{w} B{split}",
        )
        parts["logits"] = Part(
            batch * model_shape.vocab * 4, f"batchSize x vocab {model_shape.vocab} x 4 B, one step"
        )
    notes = [f"prompt + completion{' + judgement' if judge else ''}: {tokens} tokens per sequence"]
    if model.engine == RewardModelEngine.VLLM:
        notes.append(
            f"engine vllm over {tp} GPU(s): vLLM takes 0.9 of each GPU and fills what the parts leave "
            "with KV cache"
        )
    return RolePlan(
        role="reward",
        parts=parts,
        gpu_bytes=gpu_bytes,
        notes=notes,
        extra={"kind": str(model.kind), "batch_size": batch, "tensor_parallel_size": tp},
    )
