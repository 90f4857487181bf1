"""GRPOJob `spec.algorithm`: the GRPO objective, sampling and overlap settings.

Part of the API models (`grpo_operator.api.spec` assembles the job spec); the trainer's loss
and loop and the rollout sampling read these fields through the run contract.
"""

from enum import StrEnum

from pydantic import ConfigDict, Field

from grpo_operator.api.base import MAX_SEED, ApiModel, cel, immutable


class KLEstimator(StrEnum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class LossAggregation(StrEnum):
    TOKEN_MEAN = "token-mean"
    SEQUENCE_MEAN = "sequence-mean"
    TOKEN_SUM_NORM = "token-sum-norm"


class AdvantageNormalization(StrEnum):
    GROUP_STD = "group-std"
    GROUP_MEAN = "group-mean"


class PolicyLoss(StrEnum):
    GRPO = "grpo"
    GSPO = "gspo"


class ImportanceSampling(StrEnum):
    NONE = "none"
    TRUNCATED = "truncated"


class OverlongPenalty(ApiModel):
    buffer_tokens: int = Field(
        ge=1,
        le=131072,
        description="bufferTokens: required, [1, 131072], less than maxNewTokens. Completions within this "
        "many tokens of the limit are penalised.",
    )
    penalty: float = Field(
        default=1.0,
        ge=0,
        le=1000,
        description="penalty: optional, default 1.0, [0, 1000]. Largest reward reduction (at the limit).",
    )


class AlgorithmSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.overlongPenalty) || self.overlongPenalty.bufferTokens < self.maxNewTokens",
                "overlongPenalty.bufferTokens must be less than maxNewTokens",
                ".overlongPenalty.bufferTokens",
            ),
        )
    )
    group_size: int = Field(
        default=8,
        ge=2,
        le=1024,
        description="groupSize: optional, default 8, [2, 1024]. Completions per prompt.",
    )
    prompts_per_step: int = Field(
        default=32,
        ge=1,
        le=65536,
        description="promptsPerStep: optional, default 32, [1, 65536]. Prompts per optimizer step.",
    )
    micro_batch_size: int = Field(
        default=8,
        ge=1,
        le=65536,
        description="microBatchSize: optional, default 8, [1, 65536]. Sequences per forward/backward per "
        "rank.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        default=None,
        ge=1,
        le=16_777_216,
        description="maxTokensPerMicroBatch: optional, [1, 16777216]. Forms micro-batches by token count "
        "instead of microBatchSize, longest first (a longer sequence goes alone): with flash-attention "
        "the sequences are packed end to end into one row of at most this many tokens (position ids "
        "restart per sequence: no attention across them, no padding); otherwise rows of similar length "
        "are padded, rows x longest row at most this many. Long-tailed completion lengths then waste "
        "little compute; the loss is the same.",
    )
    mini_batches_per_step: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="miniBatchesPerStep: optional, default 1, [1, 1024]. Optimizer updates per pass over "
        "a step's rollouts: the batch is split into this many mini-batches (PPO-style). Above 1 the "
        "policy ratio to π_old (the policy at the step's start) moves, so clipLow/clipHigh and GSPO act.",
    )
    epochs_per_step: int = Field(
        default=1,
        ge=1,
        le=64,
        description="epochsPerStep: optional, default 1, [1, 64]. Passes over a step's rollouts; each "
        "pass makes miniBatchesPerStep optimizer updates.",
    )
    dynamic_sampling: bool = Field(
        default=False,
        description="dynamicSampling: optional, default false. DAPO's dynamic sampling: a step keeps "
        "drawing batches of promptsPerStep prompts until it has promptsPerStep groups with unequal "
        "rewards (trained), instead of shrinking when groups saturate; groups beyond that are dropped.",
    )
    max_dynamic_sampling_draws: int = Field(
        default=4,
        ge=1,
        le=64,
        description="maxDynamicSamplingDraws: optional, default 4, [1, 64]. With dynamicSampling, at most "
        "this many extra batches of promptsPerStep prompts per step; a step still short trains on what "
        "it has.",
    )
    max_steps: int = Field(
        default=1000,
        ge=1,
        le=10_000_000,
        description="maxSteps: optional, default 1000, [1, 10000000]. Optimizer steps.",
    )
    learning_rate: float = Field(
        default=1e-6,
        gt=0,
        le=1,
        description="learningRate: optional, default 1e-6, (0, 1]. AdamW learning rate.",
    )
    clip_low: float = Field(
        default=0.2,
        ge=0,
        le=1,
        description="clipLow: optional, default 0.2, [0, 1]. Ratio clipped below 1-clipLow.",
    )
    clip_high: float = Field(
        default=0.28,
        ge=0,
        le=10,
        description="clipHigh: optional, default 0.28 (DAPO's clip-higher), [0, 10]. Ratio clipped above "
        "1+clipHigh.",
    )
    kl_coef: float = Field(
        default=0.0, ge=0, le=100, description="klCoef: optional, default 0 (no reference model), [0, 100]."
    )
    kl_estimator: KLEstimator = Field(
        default=KLEstimator.K3, description="klEstimator: optional, default k3. Estimator of KL(π‖π_ref)."
    )
    entropy_coef: float = Field(
        default=0.0, ge=0, le=100, description="entropyCoef: optional, default 0, [0, 100]. Entropy bonus."
    )
    loss_aggregation: LossAggregation = Field(
        default=LossAggregation.TOKEN_MEAN,
        description="lossAggregation: optional, default token-mean. token-mean, sequence-mean or "
        "token-sum-norm "
        "(Dr. GRPO: sum over tokens divided by a constant).",
    )
    advantage_normalization: AdvantageNormalization = Field(
        default=AdvantageNormalization.GROUP_STD,
        description="advantageNormalization: optional, default group-std. group-mean drops the std (Dr. "
        "GRPO).",
    )
    policy_loss: PolicyLoss = Field(
        default=PolicyLoss.GRPO,
        description="policyLoss: optional, default grpo. gspo uses a sequence-level ratio (stabler for MoE).",
    )
    importance_sampling: ImportanceSampling = Field(
        default=ImportanceSampling.TRUNCATED,
        description="importanceSampling: optional, default truncated. Corrects rollout/trainer log-prob "
        "mismatch.",
    )
    importance_sampling_cap: float = Field(
        default=2.0,
        ge=1,
        le=1000,
        description="importanceSamplingCap: optional, default 2.0, [1, 1000]. Truncation of the IS weight.",
    )
    filter_zero_variance_groups: bool = Field(
        default=True,
        description="filterZeroVarianceGroups: optional, default true. Drop groups with equal rewards.",
    )
    overlong_penalty: OverlongPenalty | None = Field(
        default=None, description="overlongPenalty: optional. Soft penalty for completions near maxNewTokens."
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        le=16,
        description="maxStaleness: optional, default 1, [0, 16]. Policy versions rollout may lag training: "
        "the trainer keeps this many later steps generating while it trains one (0: synchronous).",
    )
    temperature: float = Field(default=1.0, gt=0, le=10, description="temperature: optional, default 1.0.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="topP: optional, default 1.0, (0, 1].")
    max_new_tokens: int = Field(
        default=256,
        ge=1,
        le=131072,
        description="maxNewTokens: optional, default 256, [1, 131072]. Completion length limit.",
    )
    seed: int = Field(
        default=0,
        ge=0,
        le=MAX_SEED,
        description="seed: optional, default 0, [0, 4294967295]. Seeds sampling and initialisation.",
    )
    routing_replay: bool = Field(
        default=False,
        description="routingReplay: optional, default false, immutable. MoE routing replay (R3): "
        "rollout servers return the top-k experts each MoE layer chose for every prompt and completion "
        "token, and the trainer's forwards reuse those choices (routing weights still come from its own "
        "router), so the importance ratio compares one network, not two routings. Costs tokens x MoE "
        "layers x top-k bytes per sequence on the wire (twice that above 256 experts). Both engines "
        "capture them (vllm: its routed-experts capture, with prefix caching on). Immutable: it changes the "
        "trainer's parameter layout in checkpoints.",
        json_schema_extra=immutable("algorithm.routingReplay"),
    )
