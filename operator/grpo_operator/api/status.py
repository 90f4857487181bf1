"""GRPOJob status: phases, conditions and progress, with their names as constants.

Written by the operator (phase, conditions, replica readiness, restarts) and by trainer
rank 0 (progress). Condition types and reasons live here so the controller, the Argo CD
health check and the tests spell them one way.
"""

from enum import StrEnum

from pydantic import Field

from grpo_operator.api.base import MAX_COUNT, ApiModel

# Every counter below is at most MAX_COUNT (2^53 - 1, exact in any JSON reader), far above what a
# job reaches; the bound keeps a corrupted status from reaching arithmetic unbounded.


class Phase(StrEnum):
    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionType(StrEnum):
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UPDATE_REJECTED = "UpdateRejected"  # a live edit the operator cannot run; the job runs on
    RECONCILE_ERROR = "ReconcileError"  # the last pass failed; retried with backoff
    PLACEMENT_DEGRADED = "PlacementDegraded"  # pods run, but placed by looser rules than rendered


class Reason(StrEnum):
    CHILDREN_CREATED = "ChildrenCreated"
    PODS_PENDING = "PodsPending"
    PODS_STARTING = "PodsStarting"
    ALL_READY = "AllReplicasReady"
    TRAINER_FAILED = "TrainerPodFailed"
    NODE_LOST = "NodeLost"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    PERMANENT_ERROR = "PermanentError"
    INVALID_SPEC = "InvalidSpec"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    SUSPENDED = "JobSuspended"
    RESUMED = "JobResumed"
    AWAITING_ADMISSION = "AwaitingAdmission"
    EVICTED = "EvictedByKueue"
    COMPLETED = "TrainingCompleted"
    ESCALATION_REFUSED = "EscalationNotApproved"
    SPEC_ACCEPTED = "SpecAccepted"
    RECOVERED = "Recovered"
    RECONCILE_FAILED = "ReconcileFailed"
    # the API server dropped matchLabelKeys from a rollout group's pod affinity (Kubernetes < 1.31)
    GROUP_AFFINITY_DROPPED = "GroupAffinityDropped"
    API_NOT_SERVED = "APINotServed"  # a child's kind whose CRD the cluster lacks (LeaderWorkerSet, PodGroup)
    # Stated by the trainer when it exits with a configuration error (`TRAINER_STATED`).
    RESUME_FROM_NOT_FOUND = "ResumeFromNotFound"
    RESUME_FROM_UNREADABLE = "ResumeFromUnreadable"
    CHECKPOINT_UNREADABLE = "CheckpointUnreadable"
    # A path or import path of the spec that does not resolve (`grpo_operator.storage.check`).
    PATH_NOT_FOUND = "PathNotFound"
    PATH_WRONG_KIND = "PathWrongKind"  # a file where a folder is expected, or the reverse
    PATH_EMPTY = "PathEmpty"
    PATH_UNREADABLE = "PathUnreadable"
    PATH_UNWRITABLE = "PathUnwritable"
    STORAGE_ACCESS_DENIED = "StorageAccessDenied"  # the credentials cannot read or write it
    MODEL_INVALID = "ModelInvalid"  # a folder, but not a Hugging Face model
    DATASET_EMPTY = "DatasetEmpty"  # no usable row
    EP_BACKEND_UNAVAILABLE = "EPBackendUnavailable"  # an EP/all2all backend this pod cannot run (named why)
    # an EFA pod its node cannot serve (RLIMIT_MEMLOCK finite: libfabric cannot pin NCCL's buffers)
    EFA_MISCONFIGURED = "EFAMisconfigured"
    # spec.reward.model cannot score as written (its prompt or model): no restart helps
    REWARD_MODEL_MISCONFIGURED = "RewardModelMisconfigured"
    # no reward model server scored anything for REWARD_DOWN_FACTOR x spec.reward.model.timeoutSeconds
    REWARD_MODEL_UNAVAILABLE = "RewardModelUnavailable"


# Reasons a trainer states in its termination message ("<Reason>: <message>"); a permanent failure
# that states one fails the job with it instead of the generic PermanentError.
TRAINER_STATED = frozenset(
    {
        Reason.RESUME_FROM_NOT_FOUND,
        Reason.RESUME_FROM_UNREADABLE,
        Reason.CHECKPOINT_UNREADABLE,
        Reason.PATH_NOT_FOUND,
        Reason.PATH_WRONG_KIND,
        Reason.PATH_EMPTY,
        Reason.PATH_UNREADABLE,
        Reason.PATH_UNWRITABLE,
        Reason.STORAGE_ACCESS_DENIED,
        Reason.MODEL_INVALID,
        Reason.DATASET_EMPTY,
        Reason.EP_BACKEND_UNAVAILABLE,
        Reason.EFA_MISCONFIGURED,
        Reason.REWARD_MODEL_MISCONFIGURED,
        Reason.REWARD_MODEL_UNAVAILABLE,
    }
)


class Condition(ApiModel):
    type: str = Field(
        description=(
            "type: one of Created, Running, Restarting, Suspended, Succeeded, Failed, UpdateRejected, "
            "ReconcileError."
        )
    )
    status: str = Field(description="status: True, False or Unknown.")
    reason: str = Field(default="", description="reason: a CamelCase word saying why the condition holds.")
    message: str = Field(default="", description="message: what happened, for humans; names pod, rank, step.")
    last_transition_time: str | None = Field(
        default=None, description="lastTransitionTime: when status last changed (RFC 3339)."
    )


class ReplicaStatus(ApiModel):
    replicas: int = Field(
        default=0, le=MAX_COUNT, description="replicas: pods wanted for this role (rollout: as autoscaled)."
    )
    ready: int = Field(default=0, le=MAX_COUNT, description="ready: pods of this role that are Ready.")
    ready_text: str = Field(default="0/0", description="readyText: 'ready/replicas', for printer columns.")
    selector: str | None = Field(
        default=None,
        description="selector: label selector of this role's pods (the scale subresource's, for HPA/KEDA).",
    )


class RolloutScalingStatus(ApiModel):
    last_scale_time: str | None = Field(
        default=None, description="lastScaleTime: when the operator last changed the rollout count."
    )
    reason: str = Field(default="", description="reason: why the count is what it is (CamelCase).")
    message: str = Field(default="", description="message: the wait share, the target and the move.")


class Progress(ApiModel):
    step: int = Field(default=0, le=MAX_COUNT, description="step: optimizer steps completed.")
    max_steps: int | None = Field(default=None, le=MAX_COUNT, description="maxSteps: steps the job will run.")
    reward_mean: float | None = Field(default=None, description="rewardMean: mean reward of the last step.")
    eval_reward: float | None = Field(
        default=None,
        description="evalReward: mean reward of greedy completions on the held-out set (spec.dataset.eval), "
        "at the last evaluation.",
    )
    eval_pass_at_k: float | None = Field(
        default=None,
        description="evalPassAtK: best of k sampled completions per held-out prompt, averaged, at the last "
        "evaluation (k = spec.dataset.eval.samples; unset when 0).",
    )
    eval_step: int | None = Field(
        default=None,
        le=MAX_COUNT,
        description="evalStep: the step evalReward was measured at (0: before training).",
    )
    tokens_per_second: float | None = Field(
        default=None, description="tokensPerSecond: generated plus trained tokens per second, last step."
    )
    rollout_seconds: float | None = Field(
        default=None, ge=0, description="rolloutSeconds: seconds the last step waited for generations."
    )
    train_seconds: float | None = Field(
        default=None, ge=0, description="trainSeconds: seconds of forward, backward and optimizer, last step."
    )
    ep_all_to_all_seconds: float | None = Field(
        default=None,
        ge=0,
        description="epAllToAllSeconds: seconds in expert-parallel dispatch and combine, last step.",
    )
    ep_backend: str | None = Field(
        default=None,
        max_length=64,
        description="epBackend: the expert-parallel backend the whole gang runs when epBackend is auto "
        "(measured at start-up: nccl, gloo, deepep_v1 or deepep_v2; set before the first step and announced "
        "by an EPBackendChosen Event); unset otherwise.",
    )
    ep_backend_failures: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description="epBackendFailures: each epBackend auto candidate that failed to build or to round-trip, "
        "with its reason (the next candidate was tried); the operator emits one EPBackendFailed Event "
        "per candidate and counts it in grpo_operator_ep_backend_failures_total.",
    )
    ep_backend_candidates: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description="epBackendCandidates: why epBackend auto chose epBackend: each candidate's seconds per "
        'dispatch+combine round trip at start-up ("1.234 ms", the slowest rank\'s; the fastest wins), or '
        '"skipped: <reason>" (refused by the layout or the installed library, counted in '
        'grpo_operator_ep_backend_refused_total) or "failed: <reason>".',
    )
    rollout_wait_fraction: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="rolloutWaitFraction: share of the trainer's wall time spent waiting for rollouts, "
        "over its last steps (what rollout.autoscaling follows).",
    )
    trained_samples: int | None = Field(
        default=None, ge=0, le=MAX_COUNT, description="trainedSamples: completions the last step trained on."
    )
    reward_timeouts: int | None = Field(
        default=None,
        ge=0,
        le=MAX_COUNT,
        description="rewardTimeouts: reward judgements out of time this attempt (scored 0, no verdict; "
        "a RewardTimeouts Warning Event says so once).",
    )
    episodes_cut_fraction: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="episodesCutFraction: share of the last step's episodes spec.algorithm.maxNewTokens "
        "ended (past half: an EpisodesCutByBudget Warning Event, once).",
    )
    weight_version: int | None = Field(
        default=None, le=MAX_COUNT, description="weightVersion: policy version on rollout."
    )
    last_checkpoint: str | None = Field(default=None, description="lastCheckpoint: path of the newest one.")
    last_checkpoint_step: int | None = Field(
        default=None, le=MAX_COUNT, description="lastCheckpointStep: its step."
    )
    resumed_from_step: int | None = Field(
        default=None,
        le=MAX_COUNT,
        description="resumedFromStep: step of the checkpoint the running attempt resumed from "
        "(unset: fresh).",
    )
    resumed_from: str | None = Field(
        default=None,
        max_length=2048,
        description="resumedFrom: path of the save the running attempt resumed from (its own checkpoint "
        "folder, or what checkpoint.resumeFrom named); unset: fresh.",
    )
    checkpoint_warning: str | None = Field(
        default=None,
        max_length=4096,
        description="checkpointWarning: newer checkpoints skipped as unreadable at the last resume, and why.",
    )
    updated_at: str | None = Field(
        default=None, description="updatedAt: when rank 0 last reported (RFC 3339)."
    )


class GRPOJobStatus(ApiModel):
    phase: Phase | None = Field(default=None, description="phase: the job's lifecycle phase.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        description="conditions: latest observations, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(
        default=None,
        le=MAX_COUNT,
        description="observedGeneration: the spec generation this status describes.",
    )
    restarts: int = Field(default=0, le=MAX_COUNT, description="restarts: trainer gang restarts so far.")
    trainer: ReplicaStatus | None = Field(default=None, description="trainer: trainer pod readiness.")
    rollout: ReplicaStatus | None = Field(default=None, description="rollout: rollout pod readiness.")
    reward: ReplicaStatus | None = Field(
        default=None,
        description="reward: reward model server readiness (spec.reward.model); unset without one.",
    )
    rollout_scaling: RolloutScalingStatus | None = Field(
        default=None,
        description="rolloutScaling: the rollout autoscaler's last move, with rollout.autoscaling.",
    )
    rollout_all2all_backend: str | None = Field(
        default=None,
        alias="rolloutAll2allBackend",  # as spec.rollout.vllm.all2allBackend
        max_length=64,
        description="rolloutAll2allBackend: the all2all backend the rollout servers' vLLM runs, "
        "rollout.vllm.all2allBackend resolved from the layout; unset where no tokens move between a "
        "server's GPUs (the torch engine, or vLLM without expert and data parallelism).",
    )
    progress: Progress | None = Field(default=None, description="progress: reported by trainer rank 0.")
    start_time: str | None = Field(default=None, description="startTime: when pods were first created.")
    completion_time: str | None = Field(default=None, description="completionTime: when it ended.")
    message: str | None = Field(default=None, description="message: the latest human-readable summary.")
