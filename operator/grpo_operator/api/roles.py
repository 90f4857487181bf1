"""GRPOJob `spec.trainer` and `spec.rollout`: what each role runs on and how its pods look.

Part of the API models (`grpo_operator.api.spec` assembles the job spec); the renderer turns
these into the two StatefulSets' pods.
"""

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from grpo_operator.api import podspec
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_operator.api.base import MAX_SECONDS, ApiModel, cel, immutable

Quantity = Annotated[str | int, Field(description="A Kubernetes quantity such as 4, '500m' or '16Gi'.")]
# Bounds on strings, lists and maps keep the API server's CEL cost estimates within its limits.
MAX_MAP = 64
MAX_LIST = 64
GENERATE_BASE_S = 600.0  # the /generate timeout's fixed part: queueing, prefill, rewards
SLOW_DECODE_TOKENS_PER_S = 10.0  # one sequence's decode rate in a full batch, taken low on purpose
INSTANCE_TYPE_PATTERN = r"^[a-z][a-z0-9-]*\.[a-z0-9-]+$"
# Images built from the repository's Dockerfile: vLLM lives only in the rollout image (it pins its own torch).
TRAINER_IMAGE = "ghcr.io/grpo-operator/trainer:0.1.0"
ROLLOUT_IMAGE = "ghcr.io/grpo-operator/rollout:0.1.0"


class EPBackend(StrEnum):
    AUTO = "auto"
    DEEPEP = "deepep"
    NCCL = "nccl"
    GLOO = "gloo"


class TrainerSharding(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"
    FULL = "full"


class OptimizerOffload(StrEnum):
    NONE = "none"
    CPU = "cpu"


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
        default=None,
        ge=-MAX_SECONDS,
        le=MAX_SECONDS,
        description="tolerationSeconds: optional, at most 315360000 (10 years). How long a NoExecute taint "
        "is tolerated; unset tolerates it forever.",
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
    spec: podspec.PodSpecOverride | None = Field(
        default=None,
        description="spec: optional. A partial core/v1 PodSpec merged onto the rendered one (volumes, "
        "sidecars, envFrom, imagePullSecrets, priorityClassName, securityContext...), checked against "
        "the Kubernetes PodSpec schema: no field is required, a container with the role's name changes "
        "the rendered container, any other container needs an image; lists and maps hold at most 256 "
        "entries, integers stay within their int32/int64 range; activeDeadlineSeconds and "
        "ephemeralContainers are refused and restartPolicy may only be Always (a StatefulSet's pods). "
        "The operator's own fields win on conflict and the conflict is reported.",
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
            (
                "self.epBackend != 'deepep' || self.expertParallelSize > 1",
                "epBackend deepep needs trainer.expertParallelSize above 1 (at 1 no token leaves its rank): "
                "raise expertParallelSize or set epBackend auto",
                ".epBackend",
            ),
            podspec.sidecars_need_images("trainer"),
        )
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="replicas: optional, default 1, [1, 1024], immutable. Trainer pods (one per node).",
        json_schema_extra=immutable("trainer.replicas"),
    )
    processes_per_pod: int = Field(
        default=8,
        ge=1,
        le=64,
        description="processesPerPod: optional, default 8, [1, 64], immutable. Ranks per pod, one per GPU "
        "on GPU nodes.",
        json_schema_extra=immutable("trainer.processesPerPod"),
    )
    expert_parallel_size: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="expertParallelSize: optional, default 1, [1, 4096], immutable. Ranks that share one "
        "copy of the experts.",
        json_schema_extra=immutable("trainer.expertParallelSize"),
    )
    ep_backend: EPBackend = Field(
        default=EPBackend.AUTO,
        description="epBackend: optional, default auto. How MoE tokens travel between expert-parallel "
        "ranks: auto (the fastest that works, measured at start-up), deepep (DeepEP v1 inside a node, v2 "
        "across EFA nodes), nccl (all-to-all on GPU nodes) or gloo (all-to-all on CPU nodes).",
    )
    sharding: TrainerSharding = Field(
        default=TrainerSharding.OPTIMIZER,
        description="sharding: optional, default optimizer. How the trainer spreads "
        "its memory: none (dense parameters and AdamW state on every rank), optimizer (AdamW state "
        "split over each parameter family's replicas, ZeRO-1), full (FSDP2 over the data-parallel "
        "dimension: dense parameters, gradients and AdamW state split over the world, bf16 compute over "
        "fp32 masters on GPU, activation checkpointing per decoder layer; experts also split in whole "
        "experts over the ranks that share an EP block when the world is larger than "
        "expertParallelSize). Experts are split by expertParallelSize in every mode.",
    )
    optimizer_offload: OptimizerOffload = Field(
        default=OptimizerOffload.NONE,
        description="optimizerOffload: optional, default none. none or cpu. cpu keeps each rank's AdamW "
        "state (fp32 moments and master copy, of its shard under any sharding mode) in pinned host memory "
        "and runs the update there with DeepSpeed's CPU Adam: GPU memory for larger models, host RAM and "
        "a slower step in exchange.",
    )
    activation_checkpointing: bool | None = Field(
        default=None,
        description="activationCheckpointing: optional, default on when sharding is full, else off. "
        "Recompute each decoder layer in backward instead of keeping its activations.",
    )


class RolloutEngine(StrEnum):
    VLLM = "vllm"
    TORCH = "torch"


class RolloutAutoscaling(ApiModel):
    """Rollout capacity that follows the trainer: more servers while it waits for generations,
    fewer while they sit idle (hysteresis between the two marks)."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "self.scaleDownBelow < self.targetWaitFraction",
                "rollout.autoscaling.scaleDownBelow must be below targetWaitFraction",
                ".scaleDownBelow",
            )
        )
    )
    target_wait_fraction: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description=(
            "targetWaitFraction: optional, default 0.1, (0, 1). Share of the trainer's wall time spent "
            "waiting for rollouts above which a server is added."
        ),
    )
    scale_down_below: float = Field(
        default=0.02,
        ge=0,
        lt=1,
        description=(
            "scaleDownBelow: optional, default 0.02, [0, 1), below targetWaitFraction. Wait share under "
            "which the rollouts are idle enough to remove a server."
        ),
    )
    scale_up_cooldown_seconds: int = Field(
        default=60,
        ge=0,
        le=86400,
        description="scaleUpCooldownSeconds: optional, default 60, [0, 86400]. Time between two scale-ups.",
    )
    scale_down_cooldown_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description=(
            "scaleDownCooldownSeconds: optional, default 300, [0, 86400]. Time after any scaling before "
            "a scale-down."
        ),
    )


class VllmAll2AllBackend(StrEnum):
    """How a vLLM server moves MoE tokens between its expert-parallel GPUs: `auto`, or a name the pinned
    vLLM accepts (`All2AllBackend`, vllm/config/parallel.py:44-58 of 0.32.0; a mirror test in the vLLM
    venv holds the list). Left out of vLLM's list: `naive` and `pplx` (removed upstream: vLLM falls
    back to allgather_reducescatter with only a log line, parallel.py:533-539), `passthrough` (bound
    by vLLM from --moe-backend, not a CLI choice, arg_utils.py:1127) and `flashinfer_all2allv` (a
    temporary alias of flashinfer_nvlink_two_sided).

    Offered but refused by CEL where the rollout image cannot start them (vLLM asserts its backend's
    package when it builds the all2all manager, distributed/device_communicators/cuda_communicator.py:
    202-278): `mori_*` (AMD ROCm's `mori`, all2all.py:997), `moonep` (`moonep`,
    utils/import_utils.py:532-543) and `nixl_ep` (`nixl_ep`, all2all.py:467) always, as the image
    installs none of them; DeepEP v1 (`deepep_high_throughput`/`deepep_low_latency`) and
    `flashinfer_nvlink_*` across nodes (nodesPerServer above 1), where v1 needs InfiniBand IBGDA and
    flashinfer a multi-node NVLink fabric, neither of which EFA nodes have. The image carries
    `deep_ep` (v2 and v1, Dockerfile ep-build) and vLLM's own dependency flashinfer-python;
    tests/unit/test_dockerfile.py holds the accepted names to what it installs."""

    AUTO = "auto"
    ALLGATHER_REDUCESCATTER = "allgather_reducescatter"
    DEEPEP_V2 = "deepep_v2"
    DEEPEP_HIGH_THROUGHPUT = "deepep_high_throughput"
    DEEPEP_LOW_LATENCY = "deepep_low_latency"
    MORI_HIGH_THROUGHPUT = "mori_high_throughput"
    MORI_LOW_LATENCY = "mori_low_latency"
    MOONEP = "moonep"
    NIXL_EP = "nixl_ep"
    FLASHINFER_NVLINK_TWO_SIDED = "flashinfer_nvlink_two_sided"
    FLASHINFER_NVLINK_ONE_SIDED = "flashinfer_nvlink_one_sided"


VLLM_DEFAULT_ALL2ALL = VllmAll2AllBackend.ALLGATHER_REDUCESCATTER
"""vLLM 0.32.0's own default (`ParallelConfig.all2all_backend`, vllm/config/parallel.py:219)."""

ALL2ALL_INSIDE_ONE_NODE = (
    VllmAll2AllBackend.DEEPEP_HIGH_THROUGHPUT,
    VllmAll2AllBackend.DEEPEP_LOW_LATENCY,
    VllmAll2AllBackend.FLASHINFER_NVLINK_TWO_SIDED,
    VllmAll2AllBackend.FLASHINFER_NVLINK_ONE_SIDED,
)
"""Backends that move tokens over NVLink only on EFA nodes: DeepEP v1's internode kernels initialise
NVSHMEM's IBGDA transport (DeepEP deep_ep/buffers/legacy.py:105-110 at the image's commit; vLLM sizes
RDMA bytes for v1 high-throughput only across nodes, all2all.py:279-284), and flashinfer's NVLink
workspaces cross hosts only through CUDA fabric handles (flashinfer 0.7.0.post1
comm/mnnvl.py:389-396)."""


def _cel_list(names: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


class VllmSpec(ApiModel):
    """The vLLM engine's knobs (rollout.engine vllm): memory, context, parallel layout, graphs."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "self.all2allBackend == 'auto' || (self.expertParallelSize > 1 && self.dataParallelSize > 1)",
                "all2allBackend is used only where a server's experts are spread over data-parallel ranks: "
                "set vllm.expertParallelSize and vllm.dataParallelSize above 1, or leave all2allBackend auto",
                ".all2allBackend",
            ),
            (
                "!(self.all2allBackend in ['mori_high_throughput', 'mori_low_latency'])",
                "rollout.vllm.all2allBackend mori_high_throughput and mori_low_latency are AMD ROCm kernels "
                "(the mori package), which the rollout image (CUDA) does not install: vLLM refuses to start "
                "without them; leave it auto or choose deepep_v2 (across nodes) or allgather_reducescatter",
                ".all2allBackend",
            ),
            (
                "self.all2allBackend != 'moonep'",
                "rollout.vllm.all2allBackend moonep needs MoonEP (the moonep package, "
                "github.com/MoonshotAI/MoonEP), which the rollout image does not install: vLLM refuses to "
                "start without it; leave it auto or choose deepep_v2 (across nodes) or "
                "allgather_reducescatter",
                ".all2allBackend",
            ),
            (
                "self.all2allBackend != 'nixl_ep'",
                "rollout.vllm.all2allBackend nixl_ep needs NIXL's EP kernels (the nixl_ep package), which "
                "the rollout image does not install: vLLM refuses to start without it; leave it auto or "
                "choose deepep_v2 (across nodes) or allgather_reducescatter",
                ".all2allBackend",
            ),
        )
    )

    gpu_memory_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="gpuMemoryUtilization: optional, default 0.9, (0, 1]. Share of each GPU vLLM may use "
        "(weights, activations, KV cache).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1048576,
        description="maxModelLen: optional, [16, 1048576]. Longest prompt plus completion; unset means the "
        "model's own limit. Lower it to fit the KV cache of a long-context model.",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="dataParallelSize: optional, default 1, [1, 64]. Model replicas inside one server, each "
        "on tensorParallelSize GPUs; the server holds tensorParallelSize x dataParallelSize GPUs.",
    )
    expert_parallel_size: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="expertParallelSize: optional, default 1, [1, 4096]. 1 slices every expert across the "
        "tensor-parallel GPUs; tensorParallelSize x dataParallelSize places whole experts on each GPU "
        "instead (vLLM's expert parallelism spans all of a server's GPUs).",
    )
    all2all_backend: VllmAll2AllBackend = Field(
        default=VllmAll2AllBackend.AUTO,
        alias="all2allBackend",  # vLLM's spelling (--all2all-backend), not the generator's all2AllBackend
        description="all2allBackend: optional, default auto. How MoE tokens travel between a server's "
        "expert-parallel GPUs, passed to vLLM as --all2all-backend: auto resolves from the layout "
        "(deepep_v2 where expert parallelism crosses EFA nodes, vLLM's own allgather_reducescatter inside "
        "one node), or a name vLLM accepts. deepep_v2 (DeepEP v2 over NCCL GIN) is the DeepEP path that "
        "works over EFA, across nodes only; deepep_high_throughput, deepep_low_latency (DeepEP v1) and "
        "flashinfer_nvlink_two_sided/one_sided run inside one node only (nodesPerServer 1); "
        "mori_high_throughput, mori_low_latency, moonep and nixl_ep are refused: the rollout image lacks "
        "their packages. Used only with expertParallelSize and dataParallelSize above 1. The resolved "
        "choice is in status.rolloutAll2allBackend and on the rollout pods.",
    )
    enforce_eager: bool = Field(
        default=False,
        description="enforceEager: optional, default false. Skip CUDA graph capture: faster start and less "
        "memory, slower decoding.",
    )
    sleep_for_updates: bool = Field(
        default=False,
        description="sleepForUpdates: optional, default false. Release the KV cache and the weights while a "
        "weight version loads (vLLM sleep level 2, woken after), so the update's buffers have the room; the "
        "prefix cache is lost, which a new version invalidates anyway. An update that breaks part-way leaves "
        "no old weights to serve: the server refuses to generate until the next whole version.",
    )


class WeightSyncTransport(StrEnum):
    AUTO = "auto"
    COLLECTIVE = "collective"
    HTTP = "http"


class WeightSync(ApiModel):
    """How each new weight version reaches the rollout servers (docs/weight-sync.md)."""

    transport: WeightSyncTransport = Field(
        default=WeightSyncTransport.AUTO,
        description=(
            "transport: optional, default auto. collective: every trainer rank streams the weights it "
            "holds over a torch.distributed group with the servers (NCCL on GPU, gloo on CPU); http: "
            "rank 0 gathers the model and POSTs it to each server. auto: collective (http stays the "
            "fallback for a network where the servers cannot reach the trainer's ports)."
        ),
    )
    bucket_mb: int = Field(
        default=256,
        ge=1,
        le=2048,
        description="bucketMb: optional, default 256, [1, 2048]. Size of one weight bucket; a trainer "
        "rank holds at most two.",
    )


class ToolCallParser(StrEnum):
    HERMES = "hermes"


class RolloutSpec(RoleCommon):
    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "!has(self.autoscaling) || (has(self.minReplicas) && has(self.maxReplicas))",
                "rollout.autoscaling needs rollout.minReplicas and rollout.maxReplicas",
                ".autoscaling",
            ),
            (
                "!has(self.autoscaling) || !has(self.minReplicas) || self.minReplicas >= 1",
                "rollout.minReplicas must be at least 1 with autoscaling (the trainer needs a server)",
                ".minReplicas",
            ),
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
            (
                "self.vllm.expertParallelSize == 1 || "
                "self.vllm.expertParallelSize == self.tensorParallelSize * self.vllm.dataParallelSize",
                "rollout.vllm.expertParallelSize must be 1 or tensorParallelSize x dataParallelSize: vLLM "
                "spreads experts over all of a server's GPUs",
                ".vllm.expertParallelSize",
            ),
            (
                "self.engine == 'vllm' || self.vllm.dataParallelSize == 1",
                "rollout.vllm.dataParallelSize needs rollout.engine vllm",
                ".vllm.dataParallelSize",
            ),
            (
                "self.nodesPerServer == 1 || self.engine == 'vllm'",
                "rollout.nodesPerServer above 1 needs rollout.engine vllm (a server spanning nodes is "
                "one vLLM engine with data parallelism across them)",
                ".nodesPerServer",
            ),
            (
                "self.nodesPerServer == 1 || has(self.instanceType)",
                "rollout.nodesPerServer above 1 needs rollout.instanceType: a server takes whole GPU nodes",
                ".nodesPerServer",
            ),
            (
                "self.nodesPerServer < 1 || self.vllm.dataParallelSize % self.nodesPerServer == 0",
                "rollout.vllm.dataParallelSize must be a multiple of rollout.nodesPerServer: each node of "
                "a server runs dataParallelSize / nodesPerServer engines of tensorParallelSize GPUs",
                ".vllm.dataParallelSize",
            ),
            (
                "self.vllm.all2allBackend != 'deepep_v2' || self.nodesPerServer > 1",
                "rollout.vllm.all2allBackend deepep_v2 is DeepEP v2 for expert parallelism across EFA "
                "nodes; inside one node (nodesPerServer 1) leave it auto (vLLM's allgather_reducescatter) "
                "or name another",
                ".vllm.all2allBackend",
            ),
            (
                "self.nodesPerServer == 1 || "
                f"!(self.vllm.all2allBackend in {_cel_list(ALL2ALL_INSIDE_ONE_NODE)})",
                "rollout.vllm.all2allBackend deepep_high_throughput, deepep_low_latency and "
                "flashinfer_nvlink_* move tokens over NVLink inside one node only: across nodes "
                "(nodesPerServer above 1) DeepEP v1 needs InfiniBand IBGDA and flashinfer a multi-node "
                "NVLink fabric, which EFA nodes lack; leave it auto (deepep_v2 across nodes) or choose "
                "allgather_reducescatter",
                ".vllm.all2allBackend",
            ),
            podspec.sidecars_need_images("rollout"),
        )
    )
    image: str = Field(
        default=ROLLOUT_IMAGE,
        min_length=1,
        max_length=512,
        description=f"image: optional, default {ROLLOUT_IMAGE} (vLLM and the torch engine). Container image.",
    )
    replicas: int = Field(
        default=1, ge=0, le=4096, description="replicas: optional, default 1, [0, 4096]. Mutable live."
    )
    min_replicas: int | None = Field(
        default=None, ge=0, le=4096, description="minReplicas: optional, [0, 4096]. Lower scaling bound."
    )
    max_replicas: int | None = Field(
        default=None, ge=1, le=4096, description="maxReplicas: optional, [1, 4096]. Upper scaling bound."
    )
    autoscaling: RolloutAutoscaling | None = Field(
        default=None,
        description=(
            "autoscaling: optional. The operator moves the rollout servers within [minReplicas, "
            "maxReplicas] on the trainer's measured wait (status.progress.rolloutWaitFraction), "
            "starting from replicas; it writes status.rollout.replicas, never spec. Not together "
            "with an HPA or KEDA on the scale subresource."
        ),
    )
    engine: RolloutEngine = Field(
        default=RolloutEngine.VLLM,
        description="engine: optional, default vllm. vllm (GPU) or torch (CPU/GPU).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="tensorParallelSize: optional, default 1, [1, 64]. GPUs of one model replica, inside one "
        "node; a server holds tensorParallelSize x vllm.dataParallelSize GPUs.",
    )
    nodes_per_server: int = Field(
        default=1,
        ge=1,
        le=64,
        description="nodesPerServer: optional, default 1, [1, 64]. Nodes one rollout server spans, one pod "
        "each: above 1 a server is a LeaderWorkerSet group (needs the LeaderWorkerSet controller, "
        "leaderworkerset.x-k8s.io) whose leader pod serves the API and whose worker pods run vLLM's headless "
        "data-parallel engines; the server's tensorParallelSize x vllm.dataParallelSize GPUs must be "
        "nodesPerServer whole nodes of instanceType. A lost pod restarts its own group only. replicas, "
        "minReplicas, maxReplicas and kubectl scale count servers, not pods.",
    )
    max_batch_size: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="maxBatchSize: optional, default 256, [1, 65536]. Sequences one server decodes at once.",
    )
    tool_call_parser: ToolCallParser = Field(
        default=ToolCallParser.HERMES,
        description="toolCallParser: optional, default hermes. How tool calls are read from the model's "
        'text (with spec.tools): hermes is the Hermes/Qwen form <tool_call>{"name": ..., '
        '"arguments": {...}}</tool_call>.',
    )
    max_turns: int = Field(
        default=8,
        ge=1,
        le=64,
        description="maxTurns: optional, default 8, [1, 64]. Model turns per episode with spec.tools: after "
        "each turn that calls tools their results are appended as tool messages and the model goes on, "
        "within algorithm.maxNewTokens over the whole episode.",
    )
    max_tool_result_chars: int = Field(
        default=4096,
        ge=64,
        le=1 << 20,
        description="maxToolResultChars: optional, default 4096, [64, 1048576]. A tool result longer than "
        "this is cut, with a visible marker, before the model reads it.",
    )
    generate_timeout_seconds: int | None = Field(
        default=None,
        ge=60,
        le=86400,
        description="generateTimeoutSeconds: optional, [60, 86400], default derived from the job: 600 + "
        "maxNewTokens / 10 x ceil(promptsPerStep x groupSize x (maxStaleness + 1) / (servers x "
        "maxBatchSize)), servers = minReplicas if set, else replicas (the decode waves a server may run "
        "at 10 tokens/s per sequence). How long the trainer waits for one /generate answer before it "
        "gives that server's prompts to the others.",
    )
    weight_sync: WeightSync = Field(
        default_factory=WeightSync,
        description="weightSync: optional. Transport and bucket size of the weight pushes.",
    )
    vllm: VllmSpec = Field(
        default_factory=VllmSpec, description="vllm: optional. The vLLM engine's knobs (engine vllm)."
    )

    def generate_timeout_s(self, algo: AlgorithmSpec) -> float:
        """generateTimeoutSeconds, else a bound that grows with the job: a server may hold a step's
        sequences (and those of the steps overlapping it) and decode maxBatchSize of them at a time,
        each wave as long as maxNewTokens at a slow rate, after a fixed allowance for queueing."""
        if self.generate_timeout_seconds is not None:
            return float(self.generate_timeout_seconds)
        servers = max(1, self.min_replicas if self.min_replicas is not None else self.replicas)
        in_flight = algo.prompts_per_step * algo.group_size * (algo.max_staleness + 1)
        waves = -(-in_flight // (servers * self.max_batch_size))
        return GENERATE_BASE_S + waves * algo.max_new_tokens / SLOW_DECODE_TOKENS_PER_S

    @property
    def gpus_per_server(self) -> int:
        """GPUs one rollout server holds: its tensor-parallel group times vLLM's data-parallel replicas."""
        return self.tensor_parallel_size * self.vllm.data_parallel_size

    @property
    def gpus_per_node(self) -> int:
        """GPUs each pod of a server holds: all of them, or a server's share of its nodes."""
        return self.gpus_per_server // self.nodes_per_server

    @property
    def data_parallel_local(self) -> int:
        """vLLM engines (data-parallel ranks) each pod of a server runs."""
        return self.vllm.data_parallel_size // self.nodes_per_server

    @property
    def spans_nodes(self) -> bool:
        return self.nodes_per_server > 1

    @property
    def streams_weights(self) -> bool:
        """Whether weights go over the collective transport: unless `http` is asked, since every
        engine applies streamed buckets (the torch engine in place, vLLM through its reload path)
        and HTTP makes rank 0 hold the whole model."""
        return self.weight_sync.transport != WeightSyncTransport.HTTP


# One NCCL communicator's GPU buffers for a broadcast (NCCL_BUFFSIZE 4 MiB per protocol, channel
# and peer of the ring it connects; NCCL >= 2.22 connects lazily): an estimate, not measured here.
NCCL_COMM_BYTES = 256 << 20


# each trainer rank's control block in every streamed bucket, and the alignment of every piece in
# it (grpo_wire.weight_stream.ALIGN, held equal by a test)
STREAM_CONTROL_BYTES = 16


def stream_chunk_bytes(senders: int, bucket_bytes: int) -> int:
    """Each trainer rank's share of a streamed round (`grpo_trainer.weight_sync.StreamSender`): all
    ranks' chunks make a member's bucket, at most half of bucketMb, so that a rank's send buffer and
    its two forwarding buffers stay within two buckets; 16-byte aligned, 16 bytes at least."""
    align = STREAM_CONTROL_BYTES
    return max(align, bucket_bytes // 2 // senders // align * align)


def stream_bucket_bytes(senders: int, bucket_bytes: int) -> int:
    """The largest bucket a receiving member gets: every trainer rank's chunk of a round and its
    control block."""
    return senders * (STREAM_CONTROL_BYTES + stream_chunk_bytes(senders, bucket_bytes))


def stream_receive_reserve(senders: int, bucket_bytes: int) -> int:
    """GPU bytes every receiving vLLM worker holds outside vLLM's budget for streamed weights: two
    buckets (`grpo_wire.weight_stream.receive_rounds`: one applied while the next arrives, both
    kept across versions) and one NCCL communicator, since a member is in one group, its feeder's,
    however many trainer ranks there are; only the control blocks grow with them (16 B a rank). One
    formula for the memory plan, which shows it, and the vLLM engine, which lowers
    gpu_memory_utilization by it."""
    return 2 * stream_bucket_bytes(senders, bucket_bytes) + NCCL_COMM_BYTES


def resolve_all2all(rollout: "RolloutSpec") -> str | None:
    """The all2all backend a rollout server's vLLM runs (pure): the one asked for, or for `auto`
    deepep_v2 where expert parallelism crosses nodes (rollout.nodesPerServer > 1) and vLLM's own
    default inside one node. None for the torch engine, and where vLLM moves no tokens between GPUs:
    its all2all kernels need expert parallelism over data-parallel ranks
    (`FusedMoEParallelConfig.use_all2all_kernels`, fused_moe/config.py:1026-1029 of 0.32.0)."""
    vllm = rollout.vllm
    if rollout.engine != RolloutEngine.VLLM or vllm.expert_parallel_size <= 1 or vllm.data_parallel_size <= 1:
        return None
    if vllm.all2all_backend != VllmAll2AllBackend.AUTO:
        return str(vllm.all2all_backend)
    if rollout.spans_nodes:
        return str(VllmAll2AllBackend.DEEPEP_V2)
    return str(VLLM_DEFAULT_ALL2ALL)
