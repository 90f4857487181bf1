"""What the memory plan needs of a GRPOJob: sizes, the trainer's sharding mode and its features.

Built by `inputs_from_spec` for `grpo-operator plan`, `grpo-operator validate` and the trainer's
start-up check (`grpo_trainer.memory`), so all three read a job the same way. The trainer it
models: sharding `none | optimizer | full` (full = FSDP2 for the dense part, experts by EP and by
FSDP2 over the EP replicas), AdamW state optionally offloaded to the host (`optimizerOffload`),
bf16 compute over fp32 master state, activation checkpointing per decoder layer (on by default
under full), log-probs in token chunks, weight sync in buckets.
"""

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from grpo_operator.api.roles import WeightSync
from grpo_operator.api.spec import GRPOJobSpec

MIB = 1024**2
GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_PROMPT_TOKENS = 1024  # the API has no prompt-length bound: an assumption, overridable
LOGITS_CHUNK_TOKENS = 1024  # the trainer's grpo_trainer.forward.LOGITS_CHUNK_TOKENS (test_mirrors)


class Sharding(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"
    FULL = "full"


@dataclass(frozen=True)
class TrainerInputs:
    """The trainer gang as the plan sees it."""

    world: int  # replicas x processesPerPod
    ep: int  # expertParallelSize
    sharding: Sharding
    micro_batch: int  # sequences per forward/backward per rank
    seq_tokens: int  # prompt + maxNewTokens: the longest padded sequence
    kl: bool  # klCoef > 0: a reference model is loaded
    compute_bytes: int  # bytes of the compute dtype (model.dtype): 2 for bf16
    rollout_bytes: int  # bytes per weight sent to rollout (model.dtype)
    activation_checkpointing: bool | None = None  # None: the trainer's default (on under full)
    optimizer_offload: bool = False  # trainer.optimizerOffload cpu: AdamW state in host RAM
    token_budget: int | None = None  # algorithm.maxTokensPerMicroBatch: micro-batches cut by tokens
    logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS
    sync_bucket_bytes: int = WeightSync().bucket_mb * MIB  # rollout.weightSync.bucketMb; a rank holds two
    runtime_bytes: int | None = None  # None: the GPU reserve (trainer.RUNTIME_BYTES); a host run passes
    # its own (e.g. benchmarks/trainer_memory.py: the process's RSS before the model is built)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch: under a token budget at most the budget, except that the
        longest sequence goes alone when it is longer (packed or padded rows alike)."""
        if self.token_budget is not None:
            return max(self.token_budget, self.seq_tokens)
        return self.micro_batch * self.seq_tokens


@dataclass(frozen=True)
class RolloutInputs:
    """One rollout server as the plan sees it."""

    engine: str  # vllm or torch
    tensor_parallel: int
    max_batch: int  # sequences decoded at once
    seq_tokens: int
    weight_bytes: int  # bytes per weight and per KV element (model.dtype)
    gpu_memory_utilization: float = 0.9  # rollout.vllm.gpuMemoryUtilization
    max_model_len: int | None = None  # rollout.vllm.maxModelLen; None: the model's own limit
    stream_senders: int = 0  # trainer ranks streaming weights to every worker (0: weights over HTTP)
    stream_bucket_bytes: int = 0  # rollout.weightSync.bucketMb
    data_parallel: int = 1  # rollout.vllm.dataParallelSize: vLLM splits the experts over TP x DP GPUs


def resolve_sharding(trainer: Any, override: str | None = None) -> Sharding:
    """The override (`plan --sharding`), else the spec's `trainer.sharding`."""
    return Sharding(override if override is not None else str(trainer.sharding))


def inputs_from_spec(
    spec: GRPOJobSpec,
    *,
    sharding: str | None = None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    activation_checkpointing: bool | None = None,
) -> tuple[TrainerInputs, RolloutInputs]:
    algo, trainer, rollout = spec.algorithm, spec.trainer, spec.rollout
    mode = resolve_sharding(trainer, sharding)
    if activation_checkpointing is None:
        activation_checkpointing = trainer.activation_checkpointing
    width = DTYPE_BYTES[str(spec.model.dtype)]
    seq = prompt_tokens + algo.max_new_tokens
    return (
        TrainerInputs(
            world=trainer.replicas * trainer.processes_per_pod,
            ep=trainer.expert_parallel_size,
            sharding=mode,
            micro_batch=algo.micro_batch_size,
            seq_tokens=seq,
            kl=algo.kl_coef > 0,
            compute_bytes=width,
            rollout_bytes=width,
            activation_checkpointing=activation_checkpointing,
            optimizer_offload=str(trainer.optimizer_offload) == "cpu",
            token_budget=algo.max_tokens_per_micro_batch,
            sync_bucket_bytes=rollout.weight_sync.bucket_mb * MIB,
        ),
        RolloutInputs(
            engine=str(rollout.engine),
            tensor_parallel=rollout.tensor_parallel_size,
            max_batch=rollout.max_batch_size,
            seq_tokens=seq,
            weight_bytes=width,
            gpu_memory_utilization=rollout.vllm.gpu_memory_utilization,
            max_model_len=rollout.vllm.max_model_len,
            stream_senders=spec.weight_stream_senders(),
            stream_bucket_bytes=rollout.weight_sync.bucket_mb * MIB,
            data_parallel=rollout.vllm.data_parallel_size,
        ),
    )
