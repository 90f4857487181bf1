"""A vLLM worker under expert parallelism declares the experts it keeps and is handed only those.

The worker's experts are vLLM's placement for its EP rank (its member index), its assembler
completes a fused expert tensor from those experts' rows alone, and vLLM's loader gets exactly
those experts' checkpoint tensors, numbered as in the checkpoint (a real tiny Qwen3-MoE checkpoint
and transformers' own reverse conversion). vLLM's CPU build runs at EP 1, so this path is checked
here piece by piece; on a GPU it runs inside vLLM's workers.
"""

from types import SimpleNamespace

import pytest
import torch
from grpo_rollout.engines.hf_names import CheckpointNames
from grpo_rollout.engines.vllm_engine import Assembler, checkpoint_named, holdings_by_member
from grpo_rollout.engines.vllm_stream import held_experts
from grpo_trainer.tiny_model import TinyConfig, save_untrained
from grpo_wire.holdings import expert_placement, held_ranges
from transformers import AutoModelForCausalLM


def vllm_config(tp=2, dp=2, pp=1, ep=True, rank=0, dp_index=0, strategy="linear", eplb=False, experts=8):
    parallel = SimpleNamespace(
        tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp, enable_expert_parallel=ep,
        enable_eplb=eplb, expert_placement_strategy=strategy, rank=rank, data_parallel_index=dp_index,
        world_size=tp * pp,
    )  # fmt: skip
    model = SimpleNamespace(hf_text_config=SimpleNamespace(num_experts=experts))
    return SimpleNamespace(parallel_config=parallel, model_config=model)


def test_a_worker_keeps_its_ep_ranks_experts_as_vllm_places_them() -> None:
    # EP = TP x DP = 4; worker (DP replica 1, TP rank 0) is member 2 = EP rank 2
    assert held_experts(vllm_config(rank=0, dp_index=1)) == expert_placement(2, 4, 8) == [4, 5]
    assert held_experts(vllm_config(rank=1, dp_index=1, strategy="round_robin")) == [3, 7]
    assert held_experts(vllm_config(ep=False)) is None  # experts sliced by TP: every worker all of them
    assert held_experts(vllm_config(tp=1, dp=1)) is None
    assert held_experts(vllm_config(pp=2)) is None  # pipeline stages: not mapped, the whole model
    with pytest.raises(ValueError, match="EPLB"):
        held_experts(vllm_config(eplb=True))


def test_the_engine_lists_holdings_in_member_order_or_none() -> None:
    assert holdings_by_member([[1, [2, 3]], [0, [0, 1]]]) == [[0, 1], [2, 3]]
    assert holdings_by_member([[0, None], [1, None]]) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-moe")
    save_untrained(out, TinyConfig())
    state = AutoModelForCausalLM.from_pretrained(out).state_dict()
    return CheckpointNames(out), state


@pytest.mark.parametrize("experts", [[2, 3], [1, 5]])
def test_the_assembler_completes_an_expert_tensor_from_its_held_rows_and_vllm_gets_those_experts(
    tiny, experts
) -> None:
    names, state = tiny
    name = "model.layers.0.mlp.experts.gate_up_proj"
    full = state[name]
    assembler = Assembler({name: list(full.shape)}, {name: experts})
    flat = full.reshape(-1)
    ranges = held_ranges(full.shape, experts)
    out = {}
    for lo, hi in ranges:  # two pieces per held range, last first: any order
        mid = (lo + hi) // 2
        out |= assembler.add([(name, mid, flat[mid:hi])])
        out |= assembler.add([(name, lo, flat[lo:mid])])
    assert assembler.missing() == [] and out[name].shape == (2, *full.shape[1:])
    named = checkpoint_named(names, out, assembler.experts_of)
    reference = names.to_checkpoint({name: full})
    prefix = "model.layers.0.mlp.experts."
    assert sorted({k.removeprefix(prefix).split(".")[0] for k in named}) == [str(e) for e in experts]
    for key, value in named.items():
        assert torch.equal(value, reference[key]), key
    with pytest.raises(ValueError, match="not in the experts held here"):
        Assembler({name: list(full.shape)}, {name: experts}).add(
            [(name, 0, flat[:10])] if 0 not in experts else []
        )
