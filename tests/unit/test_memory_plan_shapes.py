"""`memory_plan.shapes`: parameter counts from config.json, exact against real (tiny) HF models.

Each architecture `expert_parallel` supports is built from a shrunk config
(tests/support/model_configs.py) with transformers and its `numel` counted by category (routed
experts vs everything else); the formula must match to the parameter. The full-size public
configs (tests/data/model-configs) give the published totals.
"""

import json
from pathlib import Path

import pytest
from grpo_operator.memory_plan import UnsupportedModel, from_config
from transformers import AutoModelForCausalLM

from tests.support.model_configs import TINY

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model-configs"


def counted(config) -> tuple[int, int]:
    """(dense, routed-expert) parameters of the real model."""
    model = AutoModelForCausalLM.from_config(config)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return sum(p.numel() for p in model.parameters()) - expert, expert


@pytest.mark.parametrize("name", sorted(TINY))
def test_counts_match_the_real_model_exactly(name):
    config = TINY[name]()
    shape = from_config(config.to_dict())
    assert (shape.dense_total, shape.expert_total) == counted(config)
    assert shape.total == sum(shape.categories().values())


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.config.json").read_text())


def test_published_sizes():
    qwen = from_config(load("qwen3-30b-a3b"))
    assert qwen.total == 30_532_122_624  # "30.5 B"
    assert qwen.expert_total == 28_991_029_248 and qwen.dense_total == 1_541_093_376
    assert (qwen.layers, qwen.moe_layers, qwen.experts, qwen.top_k) == (48, 48, 128, 8)
    ds = from_config(load("deepseek-v3"))
    assert round(ds.total / 1e9) == 671  # without the MTP layer, which transformers does not build
    assert ds.moe_layers == 58 and ds.mla_cache == 576 and ds.kv_heads == 0
    mixtral = from_config(load("mixtral-8x7b"))
    assert round(mixtral.total / 1e8) == 467  # "46.7 B"


def test_unknown_architectures_are_refused_by_name():
    with pytest.raises(UnsupportedModel, match="llama"):
        from_config({"model_type": "llama"})
    with pytest.raises(UnsupportedModel, match="moe_intermediate_size"):
        from_config({**load("qwen3-30b-a3b"), "moe_intermediate_size": None})
