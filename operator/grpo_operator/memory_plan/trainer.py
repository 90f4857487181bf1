"""Per-GPU memory of one trainer rank, part by part (docs/memory-plan.md has the formulas).

Called through `memory_plan.plan_trainer`. Notation: P_d dense parameters (all but routed
experts), P_e routed-expert parameters, W world size, E expertParallelSize, T tokens of one
micro-batch, V vocabulary, h hidden size, a bytes of the compute dtype, N routed experts per
layer. Dense parameters are replicated over the world (or FSDP-sharded over it); experts are
split by EP and, under full sharding, also FSDP-sharded in whole experts over the W / E ranks
that share an EP block (ceil(N/E / (W/E)) experts per rank: P_e / W when that divides).
`optimizerOffload: cpu` moves the AdamW state (and its fp32 master copy) to the host: the plan's
`host` parts, not counted against the GPU.
"""

import math
from dataclasses import replace

from grpo_operator.memory_plan.inputs import GIB, Sharding, TrainerInputs
from grpo_operator.memory_plan.result import Part, RolePlan
from grpo_operator.memory_plan.shapes import ModelShape

RUNTIME_BYTES = 3 * GIB  # CUDA context, NCCL/DeepEP buffers, allocator slack
MASTER = 4  # fp32 master weights, gradients and reductions
LOGIT_FP32_COPIES = 6  # .float(), /temperature, logsumexp workspace, grad; entropy: log_softmax, exp


def experts_held(shape: ModelShape, t: TrainerInputs) -> int:
    """Routed experts per MoE layer one rank stores under full sharding: its chunk of its EP block
    (FSDP2 Shard(0) chunks: ceil, the last ranks fewer or none)."""
    block = shape.experts // t.ep
    return math.ceil(block / (t.world // t.ep)) if block else 0


def _local(shape: ModelShape, t: TrainerInputs, sharded: bool) -> tuple[float, float, str]:
    """(dense, expert) parameters one rank keeps, and the formula of their sum."""
    if not sharded:
        return shape.dense_total, shape.expert_total / t.ep, "(P_d + P_e / E)"
    held = experts_held(shape, t)
    if shape.experts and held * t.world == shape.experts:
        return shape.dense_total / t.world, shape.expert_total / t.world, "(P_d + P_e) / W"
    expert = shape.expert_total * held / max(shape.experts, 1)
    return shape.dense_total / t.world, expert, f"(P_d / W + P_e x {held} / N)"


def layer_activation_bytes(shape: ModelShape, a: int, e: int) -> tuple[float, float, float]:
    """Bytes saved for backward per token: (every layer, extra per MoE layer, extra per dense layer).

    a: compute dtype bytes, e: bytes the experts compute in (today fp32)."""
    h = shape.hidden
    base = (
        2 * (4 + a) * h  # two RMSNorms: fp32 upcast saved + output
        + a
        * (
            2 * (shape.q_dim + shape.kv_dim) + shape.attn_out + 2 * shape.latent
        )  # q/k/v (+norm/rope), attn out
        + a * h  # o_proj output
    )
    moe = (
        8 * shape.experts  # router logits and probabilities, fp32
        + shape.top_k * e * (2 * h + 4 * shape.moe_intermediate)  # dispatched rows, gate/up/act/product, down
        + a * 4 * shape.shared_intermediate
    )
    dense = a * 4 * shape.dense_intermediate
    return base, moe, dense


def plan(shape: ModelShape, t: TrainerInputs, gpu_bytes: int | None) -> RolePlan:
    a = t.compute_bytes
    full = t.sharding is Sharding.FULL
    dense, expert, local_f = _local(shape, t, full)
    local = dense + expert
    parts: dict[str, Part] = {}
    notes: list[str] = []
    parts["parameters"] = Part(int(MASTER * local), f"4 B fp32 master x {local_f}")
    parts["gradients"] = Part(int(MASTER * local), f"4 B fp32 x {local_f}")
    if t.sharding is Sharding.OPTIMIZER:
        opt, opt_f = (shape.dense_total + shape.expert_total) / t.world, "(P_d + P_e) / W"
    else:
        opt, opt_f = local, local_f
    host: dict[str, Part] = {}
    if t.optimizer_offload:
        parts["optimizer"] = Part(0, "optimizerOffload cpu: AdamW state on the host")
        host["optimizer"] = Part(int(2 * MASTER * opt), f"AdamW 2 x 4 B x {opt_f}, pinned host memory")
        host["master_copy"] = Part(int(MASTER * opt), f"fp32 copy the CPU Adam updates, 4 B x {opt_f}")
    else:
        parts["optimizer"] = Part(int(2 * MASTER * opt), f"AdamW 2 x 4 B x {opt_f}")
    layer_local = shape.layer_params(t.ep)  # FSDP2 gathers a layer's experts back to the EP block
    if full:
        unsharded = 2 * layer_local * (a + MASTER) + a * max(shape.embed, shape.lm_head)
        parts["compute_copies"] = Part(
            int(unsharded), f"FSDP2 gathers: 2 layers x ({a} B params + 4 B grads) x layer + {a} B x V x h"
        )
    else:
        parts["compute_copies"] = Part(int(a * local), f"{a} B working copy x {local_f}")
    base, moe, dense_mlp = layer_activation_bytes(shape, a, a)  # experts compute in the compute dtype
    per_token_all = (
        shape.layers * base + shape.moe_layers * moe + (shape.layers - shape.moe_layers) * dense_mlp
    )
    per_token_one = base + max(
        moe if shape.moe_layers else 0, dense_mlp if shape.moe_layers < shape.layers else 0
    )
    no_ac = t.tokens * (per_token_all + 2 * a * shape.hidden)
    with_ac = t.tokens * (shape.layers * a * shape.hidden + per_token_one + 2 * a * shape.hidden)
    logits_tokens = min(t.tokens, t.logits_chunk_tokens)
    logits = logits_tokens * shape.vocab * (a + 4 * LOGIT_FP32_COPIES)
    logits_f = f"chunk {logits_tokens} tokens x V x ({a} B + {LOGIT_FP32_COPIES} fp32 copies)"
    sync = Part(2 * t.sync_bucket_bytes, f"2 buckets x {t.sync_bucket_bytes // 2**20} MiB")
    if not t.kl:
        ref = Part(0, "klCoef = 0: no reference model")
    else:
        ref = Part(int(a * local), f"{a} B x {local_f}, sharded like the policy")
    runtime = RUNTIME_BYTES if t.runtime_bytes is None else t.runtime_bytes
    fixed = sum(p.bytes for p in parts.values()) + logits + sync.bytes + ref.bytes + runtime
    ac = t.activation_checkpointing
    if ac is None:  # the trainer's default: on under full sharding
        ac = full
    if not ac and gpu_bytes is not None and fixed + no_ac > gpu_bytes >= fixed + with_ac:
        notes.append("turn trainer.activationCheckpointing on: without it the activations do not fit")
    act_f = (
        f"T = {t.tokens} tokens x (layers x {a} B x h + one layer's saved tensors)"
        if ac
        else f"T = {t.tokens} tokens x sum over layers of saved tensors"
    )
    parts["activations"] = Part(int(with_ac if ac else no_ac), act_f)
    parts["logits"] = Part(int(logits), logits_f)
    parts["weight_sync"] = sync
    parts["reference"] = ref
    parts["runtime"] = Part(
        runtime,
        "CUDA context, NCCL/EP buffers, allocator slack"
        if t.runtime_bytes is None
        else "host process before the model (interpreter, torch, gloo), given by the caller",
    )
    return RolePlan(
        role="trainer",
        parts=parts,
        gpu_bytes=gpu_bytes,
        notes=notes,
        host=host,
        extra={
            "sharding": str(t.sharding),
            "optimizer_offload": "cpu" if t.optimizer_offload else "none",
            "activation_checkpointing": bool(ac),
            "activations_gib": {
                "without_checkpointing": round(no_ac / GIB, 2),
                "with_checkpointing": round(with_ac / GIB, 2),
            },
            "tokens_per_micro_batch": t.tokens,
        },
    )


TOKEN_STEP = 128  # token budgets are suggested in multiples of this


def largest_fitting(shape: ModelShape, t: TrainerInputs, gpu_bytes: int) -> dict[str, int] | None:
    """For a trainer that does not fit: the largest `maxTokensPerMicroBatch` that does (a multiple
    of TOKEN_STEP, at least one sequence: the longest always goes alone) and, for a job that cuts
    micro-batches by sequences, the largest `microBatchSize` that does. None when not even one
    sequence fits: the model's state is too large for the GPUs (more GPUs, sharding: full, or
    expert parallelism)."""

    def fits(inputs: TrainerInputs) -> bool:
        return bool(plan(shape, inputs, gpu_bytes).fits)

    one = replace(t, micro_batch=1, token_budget=None)
    if not fits(one):
        return None
    lo, hi = t.seq_tokens, max(t.seq_tokens, t.tokens)  # lo fits, hi does not: bisect the budget
    while hi - lo > TOKEN_STEP:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(replace(one, token_budget=mid)) else (lo, mid)
    out = {"max_tokens_per_micro_batch": max(t.seq_tokens, lo // TOKEN_STEP * TOKEN_STEP)}
    if t.token_budget is None:  # activations grow with the micro-batch: the first that fits from the top
        out["micro_batch_size"] = next(
            m for m in range(t.micro_batch - 1, 0, -1) if fits(replace(one, micro_batch=m))
        )
    return out
