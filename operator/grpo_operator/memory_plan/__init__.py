"""`grpo-operator plan`'s arithmetic: per-GPU memory of a GRPOJob's trainer, rollout and reward roles.

Pure (stdlib and `grpo_operator.api` only, so the trainer can run the very same plan at start-up
in `grpo_trainer.memory`): a model's `config.json` (`shapes`) and the job (`inputs`) give the
trainer's parts (`trainer`) and the rollout's (`rollout`), and the reward model's config.json the
reward model servers' (`reward`, spec.reward.model), each as bytes with a formula, against
the GPU memory the caller passes (the CLI and `validate` from `grpo_operator.instance_types`, the
trainer from its device). docs/memory-plan.md explains the formulas.
"""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.memory_plan import reward, rollout, trainer
from grpo_operator.memory_plan.inputs import (
    DEFAULT_PROMPT_TOKENS,
    GIB,
    RolloutInputs,
    Sharding,
    TrainerInputs,
    inputs_from_spec,
    resolve_sharding,
)
from grpo_operator.memory_plan.result import Part, RolePlan
from grpo_operator.memory_plan.shapes import ModelShape, UnsupportedModel, from_config


def find_config(model_path: str, *bases: Path) -> Path | None:
    """`config.json` of a model at a local directory (relative paths: to the CWD, then to each of
    `bases`); None for `s3://`/`pvc://` URIs and paths that do not exist here."""
    if "://" in model_path:
        return None
    for root in (Path(model_path), *(b / model_path for b in bases)):
        if (root / "config.json").is_file():
            return root / "config.json"
    return None


plan_trainer = trainer.plan
plan_rollout = rollout.plan


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    trainer: RolePlan
    rollout: RolePlan
    reward: RolePlan | None = None  # spec.reward.model's servers, when its config.json was at hand

    def to_json(self) -> dict[str, Any]:
        m = self.model
        return {
            "model": {
                "model_type": m.model_type,
                "params": m.total,
                "dense_params": m.dense_total,
                "expert_params": m.expert_total,
                "categories": m.categories(),
            },
            "trainer": self.trainer.to_json(),
            "rollout": self.rollout.to_json(),
            **({"reward": self.reward.to_json()} if self.reward is not None else {}),
        }


def plan_job(
    config: dict[str, Any],
    spec: GRPOJobSpec,
    *,
    trainer_gpu_bytes: int | None,
    rollout_gpu_bytes: int | None,
    sharding: str | None = None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    activation_checkpointing: bool | None = None,
) -> Plan:
    """The plan of `spec` for the model of `config` (a parsed config.json)."""
    shape = from_config(config)
    t, r = inputs_from_spec(
        spec,
        sharding=sharding,
        prompt_tokens=prompt_tokens,
        activation_checkpointing=activation_checkpointing,
    )
    trained = trainer.plan(shape, t, trainer_gpu_bytes)
    if trained.fits is False and trainer_gpu_bytes is not None:
        trained = _with_advice(trained, trainer.largest_fitting(shape, t, trainer_gpu_bytes), t)
    return Plan(shape, trained, rollout.plan(shape, r, rollout_gpu_bytes))


def plan_reward(
    config: dict[str, Any],
    spec: GRPOJobSpec,
    *,
    gpu_bytes: int | None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> RolePlan:
    """One reward model server of spec.reward.model, whose model is `config` (its config.json)."""
    return reward.plan(reward.shape(config), spec, gpu_bytes, prompt_tokens=prompt_tokens)


def _with_advice(plan: RolePlan, fitting: dict[str, int] | None, t: TrainerInputs) -> RolePlan:
    """A trainer that does not fit names what would: in its refusal (the trainer's start-up check
    and `validate` say it word for word) and in `plan`'s JSON."""
    if fitting is None:
        advice = (
            "not even one sequence fits: the model's state needs more GPUs (trainer.replicas), "
            "trainer.sharding: full or a larger trainer.expertParallelSize"
        )
    else:
        tokens = fitting["max_tokens_per_micro_batch"]
        options = [f"algorithm.maxTokensPerMicroBatch {tokens}"]
        if "micro_batch_size" in fitting:
            options.insert(0, f"algorithm.microBatchSize {fitting['micro_batch_size']} (was {t.micro_batch})")
        advice = "the largest that fits: " + " or ".join(options)
    return replace(plan, advice=advice, extra={**plan.extra, "largest_fitting": fitting})


__all__ = [
    "DEFAULT_PROMPT_TOKENS",
    "GIB",
    "ModelShape",
    "Part",
    "Plan",
    "RolePlan",
    "RolloutInputs",
    "Sharding",
    "TrainerInputs",
    "UnsupportedModel",
    "find_config",
    "from_config",
    "inputs_from_spec",
    "plan_job",
    "plan_reward",
    "plan_rollout",
    "plan_trainer",
    "resolve_sharding",
]
