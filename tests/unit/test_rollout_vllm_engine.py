"""The vLLM engine's CPU-checkable parts: a clear error without vllm, and the weight-name mapping.

vLLM itself needs a GPU; here we check what the engine does before vLLM sees anything: pushed
in-memory names (fused MoE experts) become the checkpoint's per-expert names, checked by shape.
"""

import importlib.util

import pytest
import torch
from grpo_rollout.engines.base import EngineConfig, create_engine
from grpo_rollout.engines.hf_names import CheckpointNames
from grpo_rollout.testing import build_tiny_model
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_missing_vllm_says_what_to_do(tiny_moe):
    with pytest.raises(RuntimeError, match=r"needs the vllm package.*spec\.rollout\.engine: torch"):
        create_engine("vllm", EngineConfig(model_path=str(tiny_moe)))


def test_fused_expert_names_map_to_the_checkpoint_tensors(tiny_moe):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    state = model.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers fuses experts in memory
    names = CheckpointNames(tiny_moe)
    on_disk = load_file(str(tiny_moe / "model.safetensors"))
    layer0 = {k: v for k, v in state.items() if k.startswith("model.layers.0.mlp.")}
    mapped = names.to_checkpoint(layer0)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in mapped
    assert all(torch.equal(v, on_disk[k]) for k, v in mapped.items())
    assert set(mapped) == {k for k in on_disk if k.startswith("model.layers.0.mlp.")}


def test_checkpoint_names_pass_through_and_bad_tensors_are_refused(tiny_moe):
    names = CheckpointNames(tiny_moe)
    good = {"model.norm.weight": torch.ones(64)}
    assert names.to_checkpoint(good) is good
    with pytest.raises(ValueError, match="shape mismatch"):
        names.to_checkpoint({"model.norm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match="unknown parameter name"):
        names.to_checkpoint({"model.layers.9.self_attn.q_proj.weight": torch.ones(1)})
