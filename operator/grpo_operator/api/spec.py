"""GRPOJob spec models: the one source of truth for every field of the API.

The CRD's OpenAPI schema (descriptions, defaults, enums, bounds, CEL rules) is generated
from these classes by `grpo_operator.crd`; pods read the run contract through them too.
Each description starts with the field's name and says optional/required and its bounds,
as Kubeflow Trainer's API types do, so `kubectl explain` is useful. The two largest parts
live beside this module: `algorithm` (spec.algorithm) and `roles` (spec.trainer, spec.rollout).
"""

import json
import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from grpo_operator.api import podspec
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_operator.api.base import (
    MAX_SECONDS,
    MAX_SEED,
    ApiModel,
    cel,
    credentials_secret_field,
    immutable,
)
from grpo_operator.api.roles import ROLLOUT_IMAGE, RoleCommon, RolloutSpec, TrainerSpec
from grpo_operator.api.storage import StorageSpec
from grpo_operator.api.tracking import TrackingSpec

URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.\-]{1,62}(/.*)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|/.*|\./.*|[A-Za-z0-9_.\-][^:]*)$"
URI_HELP = "a local path, 'pvc://<claim>/<path>' (mounted by the operator) or 's3://<bucket>/<key>'"
MAX_URI = 1024  # bounded strings keep the API server's CEL cost estimates within its limits


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


class EvalSpec(ApiModel):
    """A held-out set scored during training: greedily, and best-of-k with `samples` draws."""

    path: str = Field(
        min_length=1,
        max_length=MAX_URI,
        pattern=URI_PATTERN,
        description="path: required. Held-out prompts in the training set's format (JSON Lines or "
        f"Parquet, a file or a folder, the same promptField and reward columns): {URI_HELP}.",
    )
    every_steps: int = Field(
        default=10,
        ge=1,
        le=10_000_000,
        description="everySteps: optional, default 10, [1, 10000000]. Steps between evaluations; the "
        "set is also scored before the first step (the baseline) and after the last.",
    )
    samples: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="samples: optional, default 0, [0, 1024]. k > 0 also draws k completions per prompt "
        "at the training temperature and reports pass@k (the mean over prompts of the best of the k "
        "rewards: the share solved in k tries when a right answer scores 1 and a wrong one 0).",
    )


class ChatTemplate(StrEnum):
    AUTO = "auto"
    NONE = "none"


COLUMN_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,62}$"
# A dotted path into a row: keys (any characters but dots) and list indexes, e.g. reward_model.ground_truth.
COLUMN_PATH = r"^[^.\s]+(\.[^.\s]+)*$"
RESERVED_COLUMNS = ("prompts", "completions")  # the reward functions' own arguments
MAX_TEMPLATE_KWARGS_BYTES = 4096
TemplateKwargs = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "maxProperties": 32, "x-kubernetes-preserve-unknown-fields": True}),
]


class DatasetSpec(ApiModel):
    path: str = Field(
        min_length=1,
        max_length=MAX_URI,
        pattern=URI_PATTERN,
        description="path: required. JSON Lines (one object per line) or Parquet (.parquet) file, or a "
        f"folder of them, streamed by the trainer: {URI_HELP}.",
    )
    prompt_field: str = Field(
        default="prompt",
        min_length=1,
        max_length=253,
        description="promptField: optional, default 'prompt'. Column with the prompt: a string, or a list "
        "of chat messages ({role: system|user|assistant|tool, content}), as verl, TRL (conversational) "
        "and OpenAI-style files write it.",
    )
    columns: dict[str, Annotated[str, Field(max_length=2047, pattern=COLUMN_PATH)]] = Field(
        default_factory=dict,
        max_length=64,
        description="columns: optional. Names the reward functions (and tools and environments) receive, "
        "each mapped to a dotted path in a row (keys and list indexes), e.g. {answer: "
        "reward_model.ground_truth} for verl-prepared files; a row without the path is an error naming "
        "the file, the row and the column. A row's top-level columns are passed as well, under their "
        "own names; a mapped name wins.",
        json_schema_extra=cel(
            (
                f"self.all(k, k.matches('{COLUMN_NAME}') && !(k in {list(RESERVED_COLUMNS)}))",
                "columns: each name is an identifier (letters, digits, _), not prompts or completions",
            )
        ),
    )
    chat_template: ChatTemplate = Field(
        default=ChatTemplate.AUTO,
        description="chatTemplate: optional, default auto. auto: prompts go through the model's own chat "
        "template (tokenizer_config.json's chat_template or chat_template.jinja) with the generation "
        "prompt added, a string prompt as one user turn; a model without a template takes string "
        "prompts as raw text and refuses message lists. none: string prompts as raw text, message lists "
        "refused.",
    )
    chat_template_kwargs: TemplateKwargs = Field(
        default_factory=dict,
        description="chatTemplateKwargs: optional. Arguments the chat template reads, e.g. "
        "{enable_thinking: false} for Qwen3 (at most 32, 4 KiB of JSON).",
    )
    system_prompt: str | None = Field(
        default=None,
        max_length=32768,
        description="systemPrompt: optional. A system message put before every prompt that has none "
        "(needs the chat template).",
    )
    shuffle_seed: int = Field(
        default=0,
        ge=0,
        le=MAX_SEED,
        description="shuffleSeed: optional, default 0, [0, 4294967295]. Seed of the per-epoch prompt order.",
    )

    @field_validator("columns")
    @classmethod
    def _column_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.match(COLUMN_NAME, name) or name in RESERVED_COLUMNS:
                raise ValueError(
                    f"columns: {name!r} is not a column name "
                    f"(an identifier; not {' or '.join(RESERVED_COLUMNS)})"
                )
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_are_small_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            size = len(json.dumps(value))
        except (TypeError, ValueError) as e:
            raise ValueError(f"chatTemplateKwargs: not JSON: {e}") from None
        if size > MAX_TEMPLATE_KWARGS_BYTES or len(value) > 32:
            raise ValueError(
                f"chatTemplateKwargs: at most 32 keys and {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON"
            )
        return value

    eval: EvalSpec | None = Field(
        default=None,
        description="eval: optional. A held-out set scored greedily (temperature 0, one completion) "
        "with the job's rewards, through the rollout servers, before the first step, every "
        "everySteps and after the last; reported as status.progress.evalReward (and evalPassAtK).",
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
        default=1.0,
        ge=-1000,
        le=1000,
        description="weight: optional, default 1.0, [-1000, 1000]. Factor in the summed reward.",
    )


class BuiltinTool(StrEnum):
    CALCULATOR = "calculator"
    PYTHON = "python"


class ToolSpec(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            ("has(self.builtin) != has(self.function)", "exactly one of builtin or function must be set")
        )
    )
    builtin: BuiltinTool | None = Field(
        default=None,
        description="builtin: one of builtin/function. calculator (arithmetic) or python (runs the code it "
        "is given, under the reward sandbox's limits, and returns its output).",
    )
    function: str | None = Field(
        default=None,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="function: one of builtin/function. 'module:function' with type hints and a docstring "
        "(Args: section): its JSON schema is what the chat template's tools argument describes.",
    )


class EnvironmentSpec(ApiModel):
    class_path: str = Field(
        alias="class",
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="class: required. 'module:Class' of an interactive task: Class(**args), reset(row) -> "
        "messages (the episode's opening, from the dataset row: its prompt and columns; a function of "
        "the row, since a group's episodes start alike) and step(messages) -> {messages, reward, done} "
        "(the conversation so far, the model's last turn included; the messages to append, an optional "
        "turn reward, whether the episode is over). Runs in the reward sandbox, one instance per episode.",
    )
    args: TemplateKwargs = Field(
        default_factory=dict, description="args: optional. Keyword arguments of the class (JSON values)."
    )
    reward_weight: float = Field(
        default=1.0,
        ge=-1000,
        le=1000,
        description="rewardWeight: optional, default 1.0, [-1000, 1000]. Factor of the episode's reward "
        "(the sum of its step rewards) in the completion's reward, beside reward.functions.",
    )


class RewardModelKind(StrEnum):
    CLASSIFIER = "classifier"
    GENERATIVE = "generative"


class RewardModelEngine(StrEnum):
    TORCH = "torch"
    VLLM = "vllm"


# The judge's score in its text: the last match of scorePattern wins (judges reason, then score).
DEFAULT_SCORE_PATTERN = r"(-?[0-9]+(?:\.[0-9]+)?)"


class RewardModelSpec(RoleCommon):
    """A reward model served as a role of its own (`<job>-reward` pods): a sequence-classification
    reward model, or a generative judge asked through `prompt` and read through `scorePattern`.
    The rollout servers send it their completions in batches; its score joins reward.functions by
    `weight`."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            (
                "self.kind != 'generative' || has(self.prompt)",
                "reward.model.prompt is required for a generative judge: how the judge is asked, from "
                "{prompt}, {completion} and the row's columns",
                ".prompt",
            ),
            (
                "self.kind == 'generative' || !has(self.prompt)",
                "reward.model.prompt is for a generative judge (kind generative); a classifier scores "
                "the prompt and completion through its own chat template",
                ".prompt",
            ),
            (
                "self.engine == 'vllm' || !has(self.maxModelLen)",
                "reward.model.maxModelLen is for engine vllm (it sizes vLLM's KV cache)",
                ".maxModelLen",
            ),
            (
                "self.engine == 'vllm' || !has(self.tensorParallelSize) || self.tensorParallelSize == 1",
                "reward.model.tensorParallelSize above 1 needs engine vllm: the torch engine runs the model "
                "on one GPU",
                ".tensorParallelSize",
            ),
            podspec.sidecars_need_images("reward"),
        )
    )
    image: str = Field(
        default=ROLLOUT_IMAGE,
        min_length=1,
        max_length=512,
        description=f"image: optional, default {ROLLOUT_IMAGE} (torch, transformers). Container image.",
    )
    path: str = Field(
        min_length=1,
        max_length=MAX_URI,
        pattern=URI_PATTERN,
        description=f"path: required. The reward model, Hugging Face format: {URI_HELP}. A classifier is an "
        "AutoModelForSequenceClassification with one output (e.g. Skywork-Reward); a judge a causal LM.",
    )
    kind: RewardModelKind = Field(
        default=RewardModelKind.CLASSIFIER,
        description="kind: optional, default classifier. classifier: the model's single logit on the "
        "chat-formatted prompt and completion is the score. generative: the model writes a judgement "
        "from `prompt` and the last match of `scorePattern` in it is the score.",
    )
    engine: RewardModelEngine = Field(
        default=RewardModelEngine.TORCH,
        description="engine: optional, default torch. torch: transformers on the pod's GPU (or CPU). vllm: "
        "vLLM (the rollout image's), for large models and long judgements: a judge decodes with vLLM's "
        "batching, a classifier runs as vLLM's pooling model, over tensorParallelSize GPUs.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=8,
        description="tensorParallelSize: optional, default 1, [1, 8]. GPUs of one reward server (engine "
        "vllm above 1), inside one node: the model's layers split over them.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=16,
        le=1048576,
        description="maxModelLen: optional, engine vllm only, [16, 1048576], default the model's own "
        "context. Tokens of "
        "one input (and, for a judge, its judgement) the server takes: vLLM sizes its KV cache for it. "
        "A longer item scores 0 with the reason, counted like a judge text without a score.",
    )
    replicas: int = Field(
        default=1, ge=1, le=64, description="replicas: optional, default 1, [1, 64]. Reward model servers."
    )
    prompt: str | None = Field(
        default=None,
        min_length=1,
        max_length=16384,
        description="prompt: generative only, required there. The judge's user message, a Python format "
        "string over {prompt}, {completion} and the row's columns (spec.dataset.columns), e.g. 'Rate the "
        "answer from 0 to 10 ... Question: {prompt} Answer: {completion} Reference: {answer}'. A name "
        "the row lacks is an error on the first batch naming this field.",
    )
    score_pattern: str = Field(
        default=DEFAULT_SCORE_PATTERN,
        min_length=1,
        max_length=512,
        description="scorePattern: optional, generative only, default the last number in the text. A "
        "regular expression whose first group (else whole match), at its last match in the judge's "
        "text, is the score; a text without a match scores 0 and is counted as a parse failure.",
    )
    max_new_tokens: int = Field(
        default=512,
        ge=1,
        le=32768,
        description="maxNewTokens: optional, generative only, default 512, [1, 32768].",
    )
    weight: float = Field(
        default=1.0,
        ge=-1000,
        le=1000,
        description="weight: optional, default 1.0, [-1000, 1000]. Factor of the model's score in the "
        "summed reward, beside reward.functions.",
    )
    batch_size: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="batchSize: optional, default 16, [1, 1024]. Completions per request to a reward server.",
    )
    timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="timeoutSeconds: optional, default 120, (0, 3600]. One batch's limit on one server; "
        "past it the batch goes to another server. A request unscored after 3 x this fails its generation "
        "(reward_unavailable, retried); a model that scores nothing for 10 x this fails the job "
        "(RewardModelUnavailable).",
    )

    @field_validator("score_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"scorePattern is not a regular expression: {e}") from None
        return value


# spec.reward.credentialsSecret's keys as files in rollout pods, found through an env name the reward
# sandbox keeps (it strips secret-looking names); read by grpo_rollout.rewards.credentials
ENV_REWARD_FILES = "GRPO_REWARD_FILES"
REWARD_FILES_MOUNT = "/var/run/grpo/reward-credentials"


class RewardSpec(ApiModel):
    functions: list[RewardFunction] = Field(
        default_factory=list,
        max_length=16,
        description="functions: 0-16 entries (at least one without spec.environment). Rewards are summed "
        "by weight.",
    )
    timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        le=600,
        description="timeoutSeconds: optional, default 10, (0, 600]. A reward call past it scores 0.",
    )
    model: RewardModelSpec | None = Field(
        default=None,
        description="model: optional. A reward model or LLM judge served as a role of its own "
        "(<job>-reward), its score added by weight to the functions'.",
    )
    credentials_secret: str | None = credentials_secret_field(
        f" whose keys reward functions, tools and environments read as files (e.g. a hosted judge's API "
        f"key): mounted read-only in the rollout pods at {REWARD_FILES_MOUNT} and read with "
        "grpo_rollout.rewards.credentials.credential(key); never env, which the reward sandbox strips of "
        "secret-looking names"
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
        description=f"path: optional, default /tmp/grpo-checkpoints (pod-local: one trainer pod only, lost "
        f"with the pod). Checkpoint root: {URI_HELP}. Each job writes under <path>/<namespace>/<name>-<uid>, "
        "so a recreated job never resumes another's saves. More than one trainer pod needs s3:// or pvc://.",
    )
    every_steps: int = Field(
        default=50,
        ge=1,
        le=10_000_000,
        description="everySteps: optional, default 50, [1, 10000000]. Steps between saves.",
    )
    keep_last: int = Field(
        default=3, ge=1, le=1000, description="keepLast: optional, default 3, [1, 1000]. Saves kept."
    )
    resume_from: str | None = Field(
        default=None,
        max_length=MAX_URI,
        pattern=URI_PATTERN,
        description=f"resumeFrom: optional. Start from another run's checkpoint: {URI_HELP}; a save "
        "(<dir>/step-NNNNNNNN) or a job's checkpoint folder (its newest readable save). Any trainer world "
        "and expert-parallel size may load it. Used only while this job has no save of its own.",
    )
    export_every_steps: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="exportEverySteps: optional, [1, 10000000]; unset: only at the end. Steps between "
        "Hugging Face exports (safetensors, config, tokenizer) to <checkpoint folder>/export/step-NNNNNNNN; "
        "the final policy always goes to <checkpoint folder>/final.",
    )


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
        default=None,
        description="queue: optional. Volcano queue name. (Kueue: label the job "
        "kueue.x-k8s.io/queue-name=<LocalQueue>.)",
    )


class RunPolicy(ApiModel):
    backoff_limit: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="backoffLimit: optional, default 3, [0, 1000]. Gang restarts before Failed.",
    )
    suspend: bool = Field(
        default=False, description="suspend: optional, default false. Removes pods, keeps job."
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SECONDS,
        description="activeDeadlineSeconds: optional, [1, 315360000] (10 years). Running time before the "
        "job is Failed.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        le=MAX_SECONDS,
        description="ttlSecondsAfterFinished: optional, [0, 315360000] (10 years). Delete the job this long "
        "after it ends.",
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
                "self.trainer.replicas <= 1 || self.checkpoint.path.startsWith('s3://') || "
                "self.checkpoint.path.startsWith('pvc://')",
                "checkpoint.path must be an s3:// or pvc:// path when trainer.replicas > 1: a local path is "
                "pod-local, so no pod would hold a whole checkpoint",
                ".checkpoint.path",
            ),
            (
                "has(self.environment) || (has(self.reward) && (has(self.reward.model) || "
                "(has(self.reward.functions) && size(self.reward.functions) > 0)))",
                "reward.functions needs at least one entry unless reward.model or spec.environment scores "
                "the completions",
                ".reward.functions",
            ),
        )
    )
    model: ModelSpec = Field(description="model: required. The policy model to train.")
    dataset: DatasetSpec = Field(description="dataset: required. Prompts to train on.")
    reward: RewardSpec = Field(
        default_factory=RewardSpec,
        description="reward: how completions are scored; may be left out when spec.environment scores them.",
    )
    environment: EnvironmentSpec | None = Field(
        default=None,
        description="environment: optional. An interactive task (multi-turn): the model's turns go to its "
        "step() until it says done or rollout.maxTurns; what it writes is masked out of the loss.",
    )

    tools: list[ToolSpec] = Field(
        default_factory=list,
        max_length=32,
        description="tools: optional. Functions the model may call during an episode (multi-turn): "
        "described to it through its chat template's tools argument, called in the reward sandbox "
        "(spec.reward.timeoutSeconds each), their results appended as tool messages; tokens they "
        "write are masked out of the loss. See rollout.toolCallParser and rollout.maxTurns.",
    )
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
    storage: StorageSpec = Field(
        default_factory=StorageSpec,
        description="storage: optional. Model cache, and S3-compatible endpoint and credentials.",
    )
    tracking: TrackingSpec | None = Field(
        default=None,
        description="tracking: optional. Experiment tracking by rank 0: MLflow, TensorBoard or W&B.",
    )
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="scheduling: optional.")
    run_policy: RunPolicy = Field(
        default_factory=RunPolicy, description="runPolicy: optional. Restarts, deadlines."
    )

    def weight_stream_senders(self) -> int:
        """Trainer ranks streaming weights to every rollout worker (each in a group of its own);
        0 when weights go over HTTP."""
        return self.trainer.replicas * self.trainer.processes_per_pod if self.rollout.streams_weights else 0
