"""The per-step report: what trainer rank 0 says after each optimizer step, in one model.

Written by the trainer (`grpo_trainer.progress`) as one JSON line per step: to the file named by
ENV_PROGRESS_FILE under the local runtime, which follows it (`grpo_operator.local.progress`) for
its live table, summary and plot; in a cluster the same report becomes the GRPOJob's
`status.progress` through `to_progress`, the only place those fields are filled in.
"""

from datetime import UTC, datetime

from pydantic import BaseModel, ConfigDict, Field

from grpo_operator.api.status import Progress

ENV_PROGRESS_FILE = "GRPO_PROGRESS_FILE"  # local runtime: rank 0 appends its reports here


class EvalScore(BaseModel):
    """One scoring of the held-out set (`spec.dataset.eval`) with the job's rewards."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, description="Steps the scored policy had trained; 0: the baseline, untrained.")
    reward: float = Field(description="Mean reward of one greedy (temperature 0) completion per prompt.")
    pass_at_k: float | None = Field(
        default=None,
        description="Mean over prompts of the best of k sampled completions' rewards; None when k = 0.",
    )
    k: int = Field(ge=0, description="Sampled completions per prompt for pass_at_k (eval.samples).")
    prompts: int = Field(ge=1, description="Prompts in the held-out set.")
    seconds: float = Field(ge=0, description="Wall time of the evaluation.")


FAILED = "failed: "  # how `ep_candidates` marks a candidate that failed
SKIPPED = "skipped: "  # and one refused by the layout or the installed library
MAX_REASON = 1024


def ep_failures(candidates: dict[str, str]) -> dict[str, str]:
    """The failed `auto` candidates of a report, each with its reason (cut to MAX_REASON)."""
    return {k: v.removeprefix(FAILED)[:MAX_REASON] for k, v in candidates.items() if v.startswith(FAILED)}


def ep_progress(backend: str | None, candidates: dict[str, str]) -> dict[str, object]:
    """status.progress's EP fields (wire names) for the gang's backend and `auto`'s candidates."""
    return {
        "epBackend": backend,
        "epBackendFailures": ep_failures(candidates),
        "epBackendCandidates": {k: v[:MAX_REASON] for k, v in candidates.items()},
    }


class StepReport(BaseModel):
    """One optimizer step. Seconds are wall time of rank 0; rates count generated and trained
    tokens of the step over the step's whole wall time."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=1, description="Optimizer steps completed, this one included.")
    max_steps: int = Field(ge=1, description="Steps the job will run.")
    reward_mean: float | None = Field(description="Mean reward of the step's completions.")
    tokens_per_s: float | None = Field(ge=0, description="Prompt plus completion tokens per second.")
    samples_per_s: float | None = Field(ge=0, description="Completions per second.")
    samples: int = Field(ge=0, description="Completions in the step.")
    trained_samples: int | None = Field(
        default=None, ge=0, description="Completions the step trained on (zero-variance groups filtered)."
    )
    untrained_reason: str | None = Field(
        default=None, description="Why the step trained on no completion (its loss is then null)."
    )
    reward_timeouts_total: int | None = Field(
        default=None,
        ge=0,
        description="Reward judgements out of time in this attempt so far (each scored 0, no verdict).",
    )
    staleness: int = Field(ge=0, description="Policy versions between sampling and training.")
    weight_version: int = Field(ge=0, description="Policy version the rollout servers hold after it.")
    position: int = Field(ge=0, description="Prompts consumed so far (the data cursor).")
    step_s: float = Field(ge=0, description="Seconds of the whole step.")
    rollout_s: float = Field(ge=0, description="Seconds spent waiting for generations.")
    train_s: float = Field(ge=0, description="Seconds of forward, backward and optimizer step.")
    push_s: float = Field(ge=0, description="Seconds of the weight sync to the rollout servers.")
    rollout_wait_fraction: float | None = Field(
        default=None, ge=0, le=1, description="Share of the last steps' wall time spent waiting for rollouts."
    )
    ep_all_to_all_s: float | None = Field(
        default=None, ge=0, description="Seconds in expert-parallel dispatch and combine; None without EP."
    )
    ep_backend: str | None = Field(
        default=None, description="The EP backend `auto` chose for the whole gang; None when not `auto`."
    )
    ep_candidates: dict[str, str] = Field(
        default_factory=dict,
        description='Each `auto` candidate\'s seconds per round trip ("1.234 ms"), "skipped: <reason>" '
        '(refused by layout or library) or "failed: <reason>" (failed to build or to round-trip).',
    )
    time: float = Field(description="Unix time of the report.")
    last_checkpoint: str | None = Field(default=None, description="Path of the newest checkpoint.")
    last_checkpoint_step: int | None = Field(default=None, ge=0, description="Its step.")
    resumed_from_step: int | None = Field(
        default=None, ge=0, description="Step of the checkpoint this attempt resumed from; None when fresh."
    )
    resumed_from: str | None = Field(default=None, description="Path of that checkpoint; None when fresh.")
    checkpoint_warning: str | None = Field(
        default=None,
        description="Newer checkpoints skipped as unreadable at resume, and why (first report after it).",
    )
    metrics: dict[str, float | None] = Field(
        default_factory=dict, description="Loss terms and diagnostics (loss, grad_norm, kept, clip...)."
    )
    evals: list[EvalScore] = Field(
        default_factory=list,
        description="Held-out evaluations finished since the previous report, oldest first (the first "
        "report also carries the baseline, step 0).",
    )

    def to_progress(self) -> Progress:
        """The GRPOJob's status.progress for this report. Eval fields are set only by a report that
        carries an evaluation; the merge patch leaves the last one in place meanwhile."""
        latest = self.evals[-1] if self.evals else None
        return Progress(
            step=self.step,
            max_steps=self.max_steps,
            reward_mean=self.reward_mean,
            eval_reward=latest.reward if latest else None,
            eval_pass_at_k=latest.pass_at_k if latest else None,
            eval_step=latest.step if latest else None,
            tokens_per_second=self.tokens_per_s,
            rollout_seconds=self.rollout_s,
            rollout_wait_fraction=self.rollout_wait_fraction,
            trained_samples=self.trained_samples,
            reward_timeouts=self.reward_timeouts_total,
            episodes_cut_fraction=self.metrics.get("episodes_cut_fraction"),
            train_seconds=self.train_s,
            ep_all_to_all_seconds=self.ep_all_to_all_s,
            ep_backend=self.ep_backend,
            ep_backend_failures=ep_failures(self.ep_candidates),
            ep_backend_candidates={k: v[:MAX_REASON] for k, v in self.ep_candidates.items()},
            weight_version=self.weight_version,
            last_checkpoint=self.last_checkpoint,
            last_checkpoint_step=self.last_checkpoint_step,
            resumed_from_step=self.resumed_from_step,
            resumed_from=self.resumed_from,
            checkpoint_warning=self.checkpoint_warning[:4096] if self.checkpoint_warning else None,
            updated_at=datetime.fromtimestamp(self.time, UTC).isoformat(timespec="seconds"),
        )


class AttemptStart(BaseModel):
    """Where an attempt starts, said by rank 0 once the checkpoint is loaded, before the first step
    (which can take minutes at scale): the local runtime prints it, a cluster shows it in status."""

    model_config = ConfigDict(extra="forbid")

    attempt_start: bool = Field(default=True, description="Marks the record kind in the progress file.")
    resumed_from_step: int | None = Field(default=None, ge=0, description="Step loaded; None when fresh.")
    resumed_from: str | None = Field(default=None, description="Path of the save loaded; None when fresh.")
    ep_backend: str | None = Field(
        default=None,
        description="The EP backend `auto` chose for the gang at start-up; None when not `auto`.",
    )
    ep_candidates: dict[str, str] = Field(
        default_factory=dict, description="Why: each candidate's time, or skipped/failed with the reason."
    )
    time: float = Field(description="Unix time of the record.")

    def describe(self) -> str:
        where = (
            "starting fresh (no checkpoint to resume)"
            if self.resumed_from_step is None
            else f"resumed from step {self.resumed_from_step} ({self.resumed_from})"
        )
        if self.ep_backend is None:
            return where
        why = "; ".join(f"{k} {v}" for k, v in self.ep_candidates.items())
        return f"{where}; EP backend {self.ep_backend} (epBackend auto: {why})"

    def to_progress_patch(self) -> dict[str, object]:
        """The status.progress fields it sets (a merge patch: the step counters stay as they are):
        where the attempt starts and, before the first step, the EP backend `auto` chose and why."""
        out: dict[str, object] = {"resumedFromStep": self.resumed_from_step, "resumedFrom": self.resumed_from}
        if self.ep_backend is not None:
            out |= ep_progress(self.ep_backend, self.ep_candidates)
        return out
