"""Every table that mirrors an API enum, pinned to it: a value the API accepts must mean something
to the code that acts on it, and the code must not offer what the API cannot ask for.

The enums (operator/grpo_operator/api) are the one source; each registry below is where the
workload or the operator gives a value its meaning. Adding an option means adding it to both,
and this file says so the moment one side is forgotten.
"""

from pathlib import Path

import pytest
from grpo_operator.api.algorithm import (
    AdvantageNormalization,
    KLEstimator,
    LossAggregation,
    PolicyLoss,
)
from grpo_operator.api.roles import EPBackend, RolloutEngine, ToolCallParser
from grpo_operator.api.spec import BuiltinReward, BuiltinTool, Dtype, RewardModelEngine, RewardModelKind
from grpo_operator.api.status import GRPOJobStatus
from grpo_operator.controller.reconcile import OPERATOR_STATUS_FIELDS
from grpo_operator.lifecycle import Verdict, VerdictKind
from grpo_operator.memory_plan.inputs import TrainerInputs
from grpo_operator.memory_plan.shapes import MODEL_TYPES
from grpo_rollout.engines.base import ENGINES
from grpo_rollout.engines.routing import MOE_BLOCKS
from grpo_rollout.engines.torch_engine import DTYPES
from grpo_rollout.reward_model.base import ENGINES as REWARD_MODEL_ENGINES
from grpo_rollout.reward_model.base import KINDS as REWARD_MODEL_KINDS
from grpo_rollout.rewards.base import BUILTINS
from grpo_rollout.tools.parsers import PARSERS
from grpo_rollout.tools.registry import BUILTINS as TOOLS
from grpo_trainer import forward, moe
from grpo_trainer.advantages import ADVANTAGES
from grpo_trainer.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from grpo_trainer.moe.dispatch import BACKENDS as EP_BACKENDS

ROOT = Path(__file__).resolve().parents[2]

MIRRORS = [
    ("reward built-ins", BUILTINS, BuiltinReward),
    ("tool built-ins", TOOLS, BuiltinTool),
    ("tool-call parsers", PARSERS, ToolCallParser),
    ("rollout engines", ENGINES, RolloutEngine),
    ("policy losses", POLICY_LOSSES, PolicyLoss),
    ("KL estimators", KL_ESTIMATORS, KLEstimator),
    ("loss aggregations", AGGREGATIONS, LossAggregation),
    ("advantage normalizations", ADVANTAGES, AdvantageNormalization),
    ("torch engine dtypes", DTYPES, Dtype),
    ("reward model kinds", REWARD_MODEL_KINDS, RewardModelKind),
    ("reward model engines", REWARD_MODEL_ENGINES, RewardModelEngine),
]


@pytest.mark.parametrize(("what", "registry", "enum"), MIRRORS, ids=[m[0] for m in MIRRORS])
def test_registry_has_exactly_the_api_enums_values(what, registry, enum) -> None:
    assert set(registry) == {m.value for m in enum}, what


def test_every_ep_backend_the_api_offers_is_a_registered_backend_of_that_name() -> None:
    """No map between the two: `epBackend` is passed to the MoE layer as it is. The registry also
    holds what users do not name (`local` at EP = 1, the DeepEP versions `auto` measures)."""
    assert {m.value for m in EPBackend} <= set(EP_BACKENDS)
    assert set(EP_BACKENDS) - {m.value for m in EPBackend} == {"local", "deepep_v1", "deepep_v2"}


def test_rollout_routing_capture_knows_exactly_the_moe_blocks_the_trainer_converts() -> None:
    assert set(MOE_BLOCKS) == set(moe.ARCHITECTURES)


def test_the_memory_plan_knows_exactly_the_architectures_the_trainer_converts() -> None:
    block_of = {  # HF config model_type → its MoE block class
        "qwen3_moe": "Qwen3MoeSparseMoeBlock",
        "qwen2_moe": "Qwen2MoeSparseMoeBlock",
        "mixtral": "MixtralSparseMoeBlock",
        "deepseek_v3": "DeepseekV3MoE",
    }
    assert set(MODEL_TYPES) == set(block_of)
    assert {block_of[t] for t in MODEL_TYPES} == set(moe.ARCHITECTURES)


def test_the_memory_plan_plans_the_log_prob_chunk_the_trainer_computes_in() -> None:
    assert TrainerInputs.__dataclass_fields__["logits_chunk_tokens"].default == forward.LOGITS_CHUNK_TOKENS


def test_the_operator_writes_every_status_field_but_the_progress_rank0_owns() -> None:
    wire = {f.alias for f in GRPOJobStatus.model_fields.values()}
    assert set(OPERATOR_STATUS_FIELDS) == wire - {"progress"}


@pytest.mark.parametrize("kind", list(VerdictKind))
def test_every_verdict_kind_describes_itself(kind: VerdictKind) -> None:
    assert Verdict(kind, pod="p", role="trainer", attempt=0).describe().startswith("trainer pod p ")


def test_every_rollout_engine_builds_its_config_from_the_job() -> None:
    """The server names no engine: each one reads what it needs of the spec (`config_for`)."""
    import yaml
    from grpo_operator.api.job import GRPOJob
    from grpo_rollout.engines.base import EngineConfig, engine_class, engine_config
    from grpo_rollout.engines.vllm_engine import VllmEngineConfig

    job = GRPOJob.model_validate(yaml.safe_load((ROOT / "examples" / "p5-qwen3-30b-a3b.yaml").read_text()))
    common = dict(
        model_path="/m", dtype="bfloat16", device="cpu", max_batch_size=4, tensor_parallel_size=8, seed=1
    )
    for name in ENGINES:
        assert callable(getattr(engine_class(name), "config_for", None)), name
        config = engine_config(name, job.spec, **common)
        assert isinstance(config, EngineConfig) and config.tensor_parallel_size == 8, name
    vllm = engine_config("vllm", job.spec, **common)
    assert isinstance(vllm, VllmEngineConfig) and vllm.vllm.expert_parallel == (
        job.spec.rollout.vllm.expert_parallel_size > 1
    )
