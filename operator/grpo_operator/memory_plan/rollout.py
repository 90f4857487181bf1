"""Per-GPU memory of one rollout server: its weights and the room left for the KV cache.

Called through `memory_plan.plan_rollout`. vLLM takes `gpu_memory_utilization`
(`rollout.vllm.gpuMemoryUtilization`, 0.9 by default) of each GPU, splits the dense weights over
tensor-parallel ranks (each data-parallel replica holds them) and the routed experts over all TP x DP
GPUs of the server (whole experts under expert parallelism, slices without: `FusedMoEParallelConfig.make`
flattens TP across DP, fused_moe/config.py:1189-1200 of vLLM 0.32.0), and refuses to start unless
the KV cache holds one sequence of `max_model_len` tokens (`rollout.vllm.maxModelLen`, by default the model's
`max_position_embeddings`); fewer full-length sequences than `maxBatchSize` only means vLLM
preempts, which the plan reports as a note. The torch engine keeps the whole model on one device
and a KV cache for every sequence of the batch at once. Streamed weights (the collective
transport) reach every vLLM worker directly: its receive buffers and communicators
(`stream_receive_reserve`) come out of the same budget, the engine gives vLLM that much less.
"""

import math

from grpo_operator.api.roles import NCCL_COMM_BYTES, STREAM_CONTROL_BYTES, stream_receive_reserve
from grpo_operator.memory_plan.inputs import GIB, MIB, RolloutInputs
from grpo_operator.memory_plan.result import Part, RolePlan
from grpo_operator.memory_plan.shapes import ModelShape

RUNTIME_BYTES = 3 * GIB  # CUDA context, CUDA graphs, activations of a prefill chunk
SAMPLER_FP32_COPIES = 3  # logits, probabilities, log-probs of one decode step


def kv_bytes_per_token(shape: ModelShape, r: RolloutInputs) -> tuple[int, str]:
    """KV-cache bytes per token on one GPU, and the formula."""
    w = r.weight_bytes
    if r.engine != "vllm":  # HF cache: the expanded keys and values of every layer
        return shape.layers * shape.kv_dim * w, f"layers x (k + v width {shape.kv_dim}) x {w} B"
    if shape.mla_cache:  # MLA: one latent per token and layer, on every TP rank
        return shape.layers * shape.mla_cache * w, f"layers x (kv_lora_rank + rope {shape.mla_cache}) x {w} B"
    heads = max(1, math.ceil(shape.kv_heads / r.tensor_parallel))  # vLLM replicates heads when TP > heads
    return (
        shape.layers * 2 * heads * shape.head_dim * w,
        f"layers x 2 x ceil(kv_heads / TP) = {heads} x head_dim {shape.head_dim} x {w} B",
    )


def plan(shape: ModelShape, r: RolloutInputs, gpu_bytes: int | None) -> RolePlan:
    vllm = r.engine == "vllm"
    tp = r.tensor_parallel if vllm else 1
    dp = r.data_parallel if vllm else 1
    weights = Part(
        shape.dense_total * r.weight_bytes // tp + shape.expert_total * r.weight_bytes // (tp * dp),
        f"{r.weight_bytes} B x (dense / TP ({tp}) + routed experts / (TP x DP) ({tp * dp}))",
    )
    sampler = r.max_batch * shape.vocab * 4 * SAMPLER_FP32_COPIES
    runtime = Part(RUNTIME_BYTES + sampler, f"3 GiB + maxBatchSize x V x {SAMPLER_FP32_COPIES} fp32 copies")
    per_token, kv_f = kv_bytes_per_token(shape, r)
    budget = int(gpu_bytes * r.gpu_memory_utilization) if gpu_bytes is not None and vllm else gpu_bytes
    parts = {"weights": weights, "runtime": runtime}
    if vllm and r.stream_senders:
        reserve = stream_receive_reserve(r.stream_senders, r.stream_bucket_bytes)
        parts["weight_stream"] = Part(
            reserve,
            f"2 x (bucketMb {r.stream_bucket_bytes // MIB} MiB / 2 + {STREAM_CONTROL_BYTES} B x "
            f"{r.stream_senders} trainer ranks) + one NCCL communicator {NCCL_COMM_BYTES // MIB} MiB "
            "(one group, whatever the trainer's size), outside vLLM's gpu_memory_utilization",
        )
    notes: list[str] = []
    shortfall = None
    if vllm:
        need_tokens = r.max_model_len or shape.max_positions or r.seq_tokens
        need_what = f"one max_model_len sequence ({need_tokens} tokens)"
    else:
        need_tokens = r.max_batch * r.seq_tokens
        need_what = f"maxBatchSize x (prompt + maxNewTokens) = {need_tokens} tokens"
    extra: dict = {"engine": r.engine, "tensor_parallel": tp, "kv_bytes_per_token": per_token}
    if budget is None:
        kv = Part(need_tokens * per_token, f"{need_what} x {kv_f}")
    else:
        room = max(0, budget - sum(p.bytes for p in parts.values()))
        kv = Part(room, f"room left: budget - {' - '.join(parts)}; per token {kv_f}")
        if room < need_tokens * per_token:
            need_gib = need_tokens * per_token / GIB
            shortfall = f"KV room {room / GIB:.1f} GiB < {need_gib:.1f} GiB for {need_what}"
        full_len = room // max(per_token * r.seq_tokens, 1)
        extra |= {"kv_tokens_per_gpu": room // max(per_token, 1), "full_length_sequences": int(full_len)}
        if vllm and shortfall is None and full_len < r.max_batch:
            notes.append(
                f"KV room holds {full_len} sequences of {r.seq_tokens} tokens < maxBatchSize {r.max_batch}: "
                "vLLM preempts the rest (slower, still correct)"
            )
    if vllm:
        notes.append(f"vLLM gpu_memory_utilization {r.gpu_memory_utilization}")
    return RolePlan(
        role="rollout",
        parts={**parts, "kv_cache": kv},
        gpu_bytes=gpu_bytes,
        budget_bytes=budget,
        notes=notes,
        extra=extra,
        shortfall=shortfall,
    )
