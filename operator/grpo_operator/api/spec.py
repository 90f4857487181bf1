"""GRPOJob spec models: the one source of truth for every field of the API.

The CRD's OpenAPI schema (descriptions, defaults, enums, bounds, CEL rules) is generated
from these classes by `grpo_operator.crd`; pods read the run contract through them too.
Each description starts with the field's name and says optional/required and its bounds,
as Kubeflow Trainer's API types do, so `kubectl explain` is useful.
"""

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from grpo_operator.api.base import ApiModel, cel, immutable

Quantity = Annotated[str | int, Field(description="A Kubernetes quantity such as 4, '500m' or '16Gi'.")]
URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.\-]{1,62}(/.*)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|/.*|\./.*|[A-Za-z0-9_.\-][^:]*)$"
URI_HELP = "a local path, 'pvc://<claim>/<path>' (mounted by the operator) or 's3://<bucket>/<key>'"
# Bounds on strings, lists and maps keep the API server's CEL cost estimates within its limits.
MAX_URI = 1024
MAX_MAP = 64
MAX_LIST = 64
INSTANCE_TYPE_PATTERN = r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$"
# Images built from the repository's Dockerfile: vLLM lives only in the rollout image (it pins its own torch).
TRAINER_IMAGE = "ghcr.io/grpo-operator/trainer:0.1.0"
ROLLOUT_IMAGE = "ghcr.io/grpo-operator/rollout:0.1.0"


class Dtype(StrEnum):
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


class ModelSpec(ApiModel):
    path: str = Field(
        min_length=1,
        max_length=MAX_URI,
        pattern=URI_PATTERN,
        description=f"path: required, immutable. Hugging Face-format model: {URI_HELP}.",
        json_schema_extra=immutable("model.path"),
    )
    reference_path: str | None = Field(
        default=None,
        max_length=MAX_URI,
        pattern=URI_PATTERN,
        description="referencePath: optional. Reference model for the KL term; defaults to `path`.",
    )
    dtype: Dtype = Field(
        default=Dtype.BFLOAT16, description="dtype: optional, default bfloat16. Weights dtype."
    )


class DatasetSpec(ApiModel):
    path: str = Field(
        min_length=1,
        max_length=MAX_URI,
        pattern=URI_PATTERN,
        description=f"path: required. JSON Lines file (one object per line): {URI_HELP}.",
    )
    prompt_field: str = Field(
        default="prompt",
        min_length=1,
        max_length=253,
        description="promptField: optional, default 'prompt'. Column with the prompt.",
    )
    shuffle_seed: int = Field(
        default=0, ge=0, description="shuffleSeed: optional, default 0. Seed of the per-epoch prompt order."
    )


class BuiltinReward(StrEnum):
    EXACT_MATCH = "exact_match"
    MATH = "math"
    COUNTDOWN = "countdown"
    FORMAT = "format"


class RewardFunction(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            ("has(self.builtin) != has(self.function)", "exactly one of builtin or function must be set")
        )
    )
    builtin: BuiltinReward | None = Field(
        default=None, description="builtin: one of builtin/function. A reward shipped with the rollout image."
    )
    function: str | None = Field(
        default=None,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="function: one of builtin/function. 'module:function' with TRL's batch signature "
        "fn(prompts, completions, **columns) -> list[float].",
    )
    weight: float = Field(
        default=1.0, description="weight: optional, default 1.0. Factor in the summed reward."
    )


class RewardSpec(ApiModel):
    functions: list[RewardFunction] = Field(
        min_length=1,
        max_length=16,
        description="functions: required, 1-16 entries. Rewards are summed by weight.",
    )
    timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="timeoutSeconds: optional, default 10, (0, 600]. A reward call past it scores 0.",
    )


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
        description="bufferTokens: required. Completions within this many tokens of the limit are penalised.",
    )
    penalty: float = Field(
        default=1.0,
        ge=0,
        description="penalty: optional, default 1.0. Largest reward reduction (at the limit).",
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
        description="promptsPerStep: optional, default 32. Prompts per optimizer step.",
    )
    micro_batch_size: int = Field(
        default=8,
        ge=1,
        description="microBatchSize: optional, default 8. Sequences per forward/backward per rank.",
    )
    max_steps: int = Field(
        default=1000, ge=1, description="maxSteps: optional, default 1000. Optimizer steps."
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
    kl_coef: float = Field(default=0.0, ge=0, description="klCoef: optional, default 0 (no reference model).")
    kl_estimator: KLEstimator = Field(
        default=KLEstimator.K3, description="klEstimator: optional, default k3. Estimator of KL(π‖π_ref)."
    )
    entropy_coef: float = Field(
        default=0.0, ge=0, description="entropyCoef: optional, default 0. Entropy bonus."
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
        description="importanceSamplingCap: optional, default 2.0, ≥ 1. Truncation of the IS weight.",
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
        description="maxNewTokens: optional, default 256. Completion length limit.",
    )
    seed: int = Field(
        default=0, ge=0, description="seed: optional, default 0. Seeds sampling and initialisation."
    )
    routing_replay: bool = Field(
        default=False,
        description="routingReplay: optional, default false, immutable. MoE routing replay (R3): "
        "rollout servers return the top-k experts each MoE layer chose for every prompt and completion "
        "token, and the trainer's forwards reuse those choices (routing weights still come from its own "
        "router), so the importance ratio compares one network, not two routings. Costs tokens x MoE "
        "layers x top-k bytes per sequence on the wire (twice that above 256 experts). Needs "
        "rollout.engine torch. Immutable: it changes the trainer's parameter layout in checkpoints.",
        json_schema_extra=immutable("algorithm.routingReplay"),
    )


class EPBackend(StrEnum):
    AUTO = "auto"
    DEEPEP = "deepep"
    NCCL = "nccl"
    GLOO = "gloo"


class Toleration(ApiModel):
    """A Kubernetes toleration, copied onto the role's pods."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
                "value must be empty when operator is Exists",
                ".value",
            ),
        )
    )
    key: str | None = Field(
        default=None, max_length=317, description="key: optional. Taint key; empty matches all."
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="operator: optional, Exists or Equal (the default when unset)."
    )
    value: str | None = Field(default=None, max_length=63, description="value: optional. Taint value.")
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None,
        description="effect: optional. NoSchedule, PreferNoSchedule or NoExecute; empty matches all.",
    )
    toleration_seconds: int | None = Field(
        default=None, description="tolerationSeconds: optional. How long a NoExecute taint is tolerated."
    )


class Resources(ApiModel):
    """Container resources, as in a PodSpec."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict, max_length=MAX_MAP, description="requests: optional. Minimum resources."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, max_length=MAX_MAP, description="limits: optional. Maximum resources."
    )


class PodMetadata(ApiModel):
    """Labels and annotations added to a role's pods."""

    labels: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_MAP, description="labels: optional. Added to the pods."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_MAP, description="annotations: optional. Added to pods."
    )


class PodTemplateOverride(ApiModel):
    metadata: PodMetadata | None = Field(
        default=None, description="metadata: optional. Pod labels, annotations."
    )
    spec: dict[str, Any] | None = Field(
        default=None,
        description="spec: optional. A partial PodSpec merged onto the rendered one (volumes, sidecars, "
        "envFrom, imagePullSecrets, priorityClassName, securityContext...). The operator's own fields "
        "win on conflict and the conflict is reported.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


class RoleCommon(ApiModel):
    """Fields both roles share: image, placement, resources and pod overrides."""

    image: str = Field(
        default=TRAINER_IMAGE,
        min_length=1,
        max_length=512,
        description=f"image: optional, default {TRAINER_IMAGE}. Container image.",
    )
    instance_type: str | None = Field(
        default=None,
        max_length=64,
        pattern=INSTANCE_TYPE_PATTERN,
        description="instanceType: optional. EC2 instance type (node selector and the EFA/GPU table); "
        "unset means CPU pods without GPUs or EFA.",
    )
    resources: Resources | None = Field(
        default=None, description="resources: optional. Merged over what the instance type implies."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_MAP,
        description="nodeSelector: optional, at most 64 entries. Added to the instance-type selector.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=MAX_LIST,
        description="tolerations: optional, at most 64. Added to the GPU/EFA taint tolerations.",
    )
    service_account_annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_MAP,
        description="serviceAccountAnnotations: optional. E.g. eks.amazonaws.com/role-arn for IRSA.",
    )
    template: PodTemplateOverride | None = Field(
        default=None, description="template: optional. Pod template overrides merged onto the rendered pods."
    )


class TrainerSpec(RoleCommon):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "(self.replicas * self.processesPerPod) % self.expertParallelSize == 0",
                "expertParallelSize must divide replicas * processesPerPod",
                ".expertParallelSize",
            ),
            (
                "self.epBackend != 'deepep' || has(self.instanceType)",
                "epBackend deepep needs GPU nodes: set trainer.instanceType",
                ".epBackend",
            ),
        )
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="replicas: optional, default 1, immutable. Trainer pods (one per node).",
        json_schema_extra=immutable("trainer.replicas"),
    )
    processes_per_pod: int = Field(
        default=8,
        ge=1,
        le=64,
        description="processesPerPod: optional, default 8, immutable. Ranks per pod, one per GPU on GPU "
        "nodes.",
        json_schema_extra=immutable("trainer.processesPerPod"),
    )
    expert_parallel_size: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="expertParallelSize: optional, default 1, immutable. Ranks that share one copy of the "
        "experts.",
        json_schema_extra=immutable("trainer.expertParallelSize"),
    )
    ep_backend: EPBackend = Field(
        default=EPBackend.AUTO, description="epBackend: optional, default auto. auto, deepep, nccl or gloo."
    )
    zero_stage: int = Field(
        default=1,
        ge=0,
        le=1,
        description="zeroStage: optional, default 1, [0, 1]. 1 shards the AdamW state over each "
        "parameter family's replicas (ZeRO stage 1); 0 keeps a full copy on every rank. Stages 2 and 3 "
        "(sharded gradients and weights) are not implemented, so they are refused rather than run as 1.",
    )


class RolloutEngine(StrEnum):
    VLLM = "vllm"
    TORCH = "torch"


class RolloutSpec(RoleCommon):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.minReplicas) || self.minReplicas <= self.replicas",
                "rollout.minReplicas must be <= rollout.replicas",
                ".minReplicas",
            ),
            (
                "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
                "rollout.replicas must be <= rollout.maxReplicas",
                ".maxReplicas",
            ),
        )
    )
    image: str = Field(
        default=ROLLOUT_IMAGE,
        min_length=1,
        max_length=512,
        description=f"image: optional, default {ROLLOUT_IMAGE} (vLLM and the torch engine). Container image.",
    )
    replicas: int = Field(
        default=1, ge=0, le=4096, description="replicas: optional, default 1. Mutable live."
    )
    min_replicas: int | None = Field(
        default=None, ge=0, le=4096, description="minReplicas: optional, [0, 4096]. Lower scaling bound."
    )
    max_replicas: int | None = Field(
        default=None, ge=1, le=4096, description="maxReplicas: optional, [1, 4096]. Upper scaling bound."
    )
    engine: RolloutEngine = Field(
        default=RolloutEngine.VLLM,
        description="engine: optional, default vllm. vllm (GPU) or torch (CPU/GPU).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="tensorParallelSize: optional, default 1. GPUs per rollout server.",
    )
    max_batch_size: int = Field(
        default=256,
        ge=1,
        description="maxBatchSize: optional, default 256. Sequences one server decodes at once.",
    )


class EFAMode(StrEnum):
    AUTO = "auto"
    REQUIRED = "required"
    DISABLED = "disabled"


class NetworkSpec(ApiModel):
    efa: EFAMode = Field(
        default=EFAMode.AUTO,
        description="efa: optional, default auto. auto uses EFA where the instance type has it; required "
        "fails the job if it does not; disabled renders plain pods.",
    )
    privileged: bool = Field(default=False, description="privileged: optional, default false. Opt-in only.")
    hugepages: str = Field(
        default="5120Mi",
        max_length=16,
        pattern=r"^[0-9]+(Mi|Gi)$",
        description="hugepages: optional, default 5120Mi (2Mi pages).",
    )
    socket_ifname: str = Field(
        default="^lo,docker,veth",
        max_length=256,
        description="socketIfname: optional. NCCL_SOCKET_IFNAME for bootstrap traffic.",
    )


class CheckpointSpec(ApiModel):
    path: str = Field(
        default="/tmp/grpo-checkpoints",
        max_length=MAX_URI,
        pattern=URI_PATTERN,
        description=f"path: optional. Checkpoint root: {URI_HELP}.",
    )
    every_steps: int = Field(
        default=50, ge=1, description="everySteps: optional, default 50. Steps between saves."
    )
    keep_last: int = Field(default=3, ge=1, le=1000, description="keepLast: optional, default 3. Saves kept.")


class PodGroupKind(StrEnum):
    NONE = "none"
    SCHEDULER_PLUGINS = "scheduler-plugins"
    VOLCANO = "volcano"


class SchedulingSpec(ApiModel):
    pod_group: PodGroupKind = Field(
        default=PodGroupKind.NONE,
        description="podGroup: optional, default none. Create a PodGroup for gang scheduling.",
    )
    scheduler_name: str | None = Field(default=None, description="schedulerName: optional. Pods' scheduler.")
    priority_class_name: str | None = Field(default=None, description="priorityClassName: optional.")
    queue: str | None = Field(
        default=None, description="queue: optional. Volcano queue or Kueue LocalQueue name."
    )


class RunPolicy(ApiModel):
    backoff_limit: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="backoffLimit: optional, default 3. Gang restarts before Failed.",
    )
    suspend: bool = Field(
        default=False, description="suspend: optional, default false. Removes pods, keeps job."
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="activeDeadlineSeconds: optional. Running time before the job is Failed.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="ttlSecondsAfterFinished: optional. Delete the job this long after it ends.",
    )


class GRPOJobSpec(ApiModel):
    """What to train, on what, and how; the operator never writes it (defaults come from the CRD)."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "self.network.efa != 'required' || has(self.trainer.instanceType)",
                "network.efa required needs EFA nodes: set trainer.instanceType",
                ".network.efa",
            ),
            (
                "!self.algorithm.routingReplay || self.rollout.engine != 'vllm'",
                "algorithm.routingReplay needs rollout.engine torch: the vllm engine does not return "
                "routed experts yet",
                ".algorithm.routingReplay",
            ),
        )
    )
    model: ModelSpec = Field(description="model: required. The policy model to train.")
    dataset: DatasetSpec = Field(description="dataset: required. Prompts to train on.")
    reward: RewardSpec = Field(description="reward: required. How completions are scored.")
    algorithm: AlgorithmSpec = Field(
        default_factory=AlgorithmSpec, description="algorithm: optional. GRPO settings."
    )
    trainer: TrainerSpec = Field(
        default_factory=TrainerSpec, description="trainer: optional. The training gang."
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec, description="rollout: optional. Generation servers."
    )
    network: NetworkSpec = Field(default_factory=NetworkSpec, description="network: optional. EFA and NCCL.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="checkpoint: optional.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="scheduling: optional.")
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy, description="runPolicy: optional. Restarts, deadlines."
    )
