"""The vLLM engine's CPU-checkable parts: a clear error without vllm, the weight-name mapping, and
the pure conversions around AsyncLLM (sampling and engine arguments, outputs to samples, routed
experts to the wire form, streamed pieces to whole tensors).

vLLM itself needs a GPU (benchmarks/gpu/rollout_vllm_gpu.py runs it); here we check what the engine
does before vLLM sees anything and after it answers, on plain data shaped like vLLM's outputs.
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from grpo_rollout.engines.base import EngineConfig, create_engine
from grpo_rollout.engines.hf_names import CheckpointNames
from safetensors.torch import load_file

from tests.support.rollout import build_tiny_model


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


# -- the pure parts of the AsyncLLM engine: plain data in, plain data out ----------------------------


def test_one_request_per_prompt_with_n_samples_and_the_sampled_tokens_logprob():
    from grpo_rollout.engines.vllm_engine import sampling_kwargs
    from grpo_wire.protocol import Sampling

    kw = sampling_kwargs(8, Sampling(temperature=0.7, top_p=0.9, max_new_tokens=32, seed=5))
    assert kw == {"n": 8, "temperature": 0.7, "top_p": 0.9, "max_tokens": 32, "logprobs": 0, "seed": 5}
    assert "seed" not in sampling_kwargs(2, Sampling(max_new_tokens=4))


def test_engine_args_carry_the_spec_knobs_and_capture_routing_only_when_asked():
    from grpo_operator.api.spec import GRPOJobSpec
    from grpo_rollout.engines.vllm_engine import WORKER_EXTENSION, VllmEngineConfig, engine_args, vllm_options

    spec = GRPOJobSpec.model_validate(
        {
            "model": {"path": "/m"},
            "dataset": {"path": "/d.jsonl"},
            "reward": {"functions": [{"builtin": "math"}]},
            "algorithm": {"routingReplay": True},
            "rollout": {
                "tensorParallelSize": 2,
                "vllm": {
                    "gpuMemoryUtilization": 0.8,
                    "maxModelLen": 4096,
                    "dataParallelSize": 4,
                    "expertParallelSize": 8,
                    "enforceEager": True,
                    "sleepForUpdates": True,
                    "all2allBackend": "deepep_low_latency",
                },
            },
        }
    )
    assert spec.rollout.gpus_per_server == 8
    args = engine_args(VllmEngineConfig(model_path="/m", tensor_parallel_size=2, vllm=vllm_options(spec)))
    assert args["gpu_memory_utilization"] == 0.8 and args["max_model_len"] == 4096
    assert args["tensor_parallel_size"] == 2 and args["data_parallel_size"] == 4
    assert args["enable_expert_parallel"] and args["enforce_eager"] and args["enable_sleep_mode"]
    assert args["enable_return_routed_experts"] and args["enable_prefix_caching"]
    assert args["logprobs_mode"] == "processed_logprobs" and args["worker_extension_cls"] == WORKER_EXTENSION
    assert args["all2all_backend"] == "deepep_low_latency"  # resolve_all2all: what status and the pod say
    plain = engine_args(EngineConfig(model_path="/m"))
    assert "enable_return_routed_experts" not in plain and "max_model_len" not in plain
    assert "all2all_backend" not in plain  # no expert and data parallelism: vLLM runs none
    assert not plain["enable_expert_parallel"] and not plain["enable_sleep_mode"]


def test_the_worker_extension_is_importable_by_its_name():
    import importlib

    from grpo_rollout.engines.vllm_engine import WORKER_EXTENSION

    module, _, cls = WORKER_EXTENSION.rpartition(".")
    loader = getattr(importlib.import_module(module), cls)
    steps = ("grpo_begin_update", "grpo_load_bucket", "grpo_finish_update", "grpo_abort_update")
    assert all(hasattr(loader, m) for m in steps)


def test_routing_replay_is_refused_where_vllm_has_no_triton_with_what_to_change():
    from grpo_rollout.engines.vllm_engine import routed_experts_refusal

    assert routed_experts_refusal(has_triton=True) is None
    why = routed_experts_refusal(has_triton=False)
    assert why is not None and "Model Runner V2" in why and "spec.algorithm.routingReplay: false" in why


@pytest.mark.parametrize(
    ("config", "layers"),
    [
        ({"num_hidden_layers": 4, "decoder_sparse_step": 1, "mlp_only_layers": []}, [0, 1, 2, 3]),
        ({"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": []}, [1, 3]),
        ({"num_hidden_layers": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0]}, [1, 2, 3]),
        ({"num_hidden_layers": 5, "first_k_dense_replace": 3, "moe_layer_freq": 1}, [3, 4]),
        ({"num_hidden_layers": 3, "num_local_experts": 8}, [0, 1, 2]),
    ],
)
def test_moe_layers_are_the_ones_the_trainer_replays(config, layers):
    from grpo_rollout.engines.vllm_engine import moe_layer_ids

    assert moe_layer_ids(config) == layers


def _completion(tokens, logps, routed=None, finish="stop", index=0):
    """A vLLM CompletionOutput's fields, as plain data."""
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps, strict=True)]
    return SimpleNamespace(
        index=index, token_ids=tokens, logprobs=steps, finish_reason=finish, text="x", routed_experts=routed
    )


def test_a_completion_becomes_a_sample_with_its_moe_layers_routing():
    import numpy as np
    from grpo_rollout.engines.vllm_engine import RoutingLayout, to_sample

    prompt_len, tokens = 3, [7, 8]
    rows = prompt_len + len(tokens) - 1
    # vLLM's capture covers every decoder layer; layer 0 is dense here, so its rows are not sent
    captured = np.arange(rows * 3 * 2, dtype=np.uint8).reshape(rows, 3, 2)
    sample = to_sample(_completion(tokens, [-0.5, -1.25], captured), prompt_len, RoutingLayout([1, 2], 4))
    assert sample.token_ids == tokens and sample.logprobs == [-0.5, -1.25] and sample.finish_reason == "stop"
    assert sample.routing is not None and sample.routing.shape == (rows, 2, 2)
    assert sample.routing.raw() == captured[:, [1, 2], :].tobytes()
    plain = to_sample(_completion(tokens, [-0.5, -1.25], finish="length"), prompt_len, None)
    assert plain.routing is None and plain.finish_reason == "length"
    with pytest.raises(RuntimeError, match="no routed experts"):
        to_sample(_completion(tokens, [-0.5, -1.25]), prompt_len, RoutingLayout([0], 4))


def test_more_than_256_experts_travel_as_int16():
    import numpy as np
    from grpo_rollout.engines.vllm_engine import encode_routed_experts

    captured = np.array([[[300, 2]], [[5, 511]]], dtype=np.uint16)
    routing = encode_routed_experts(captured, [0], 2, 512)
    assert routing.dtype == "int16" and routing.raw() == captured.astype("<i2").tobytes()
    with pytest.raises(RuntimeError, match="fewer than the 3 routed tokens"):
        encode_routed_experts(captured, [0], 3, 512)


def test_pieces_are_assembled_into_whole_tensors_as_they_complete():
    from grpo_rollout.engines.vllm_engine import Assembler

    a = Assembler({"w": (2, 3), "b": (4,)})
    full_b = torch.arange(4.0)
    assert set(a.add([("b", 0, full_b), ("w", 0, torch.arange(2.0))])) == {"b"}
    done = a.add([("w", 2, torch.arange(2.0, 6.0))])
    assert torch.equal(done["w"], torch.arange(6.0).view(2, 3)) and a.missing() == []
    with pytest.raises(ValueError, match="did not announce or already completed"):
        a.add([("b", 0, full_b)])
    with pytest.raises(ValueError, match="outside"):
        Assembler({"w": (2,)}).add([("w", 1, torch.ones(2))])


def test_a_tied_head_is_dropped_and_everything_else_is_checked_by_name_and_shape(tmp_path):
    from grpo_rollout.engines.vllm_engine import checkpoint_named
    from safetensors.torch import save_file

    model_dir = build_tiny_model(tmp_path / "tied", arch="qwen2")
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["lm_head.weight"]  # a tied checkpoint stores the embedding once
    save_file(weights, str(model_dir / "model.safetensors"))
    tied = CheckpointNames(model_dir)
    assert "lm_head.weight" not in tied.shapes
    embed = tied.shapes["model.embed_tokens.weight"]
    pushed = {"lm_head.weight": torch.empty(embed, device="meta"), "model.norm.weight": torch.empty(64)}
    assert set(checkpoint_named(tied, pushed)) == {"model.norm.weight"}
    with pytest.raises(ValueError, match="shape mismatch"):
        checkpoint_named(tied, {"model.norm.weight": torch.empty(3, device="meta")})


def test_a_whole_streamed_version_is_checked_on_meta_tensors(tiny_moe):
    """begin_update's check: every pushed (fused) name maps to checkpoint tensors, nothing allocated."""
    from grpo_rollout.engines.vllm_engine import checkpoint_named
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_moe).state_dict()
    meta = {k: torch.empty(v.shape, device="meta") for k, v in state.items()}
    names = CheckpointNames(tiny_moe)
    mapped = checkpoint_named(names, meta)
    assert set(mapped) == set(load_file(str(tiny_moe / "model.safetensors")))
    # a bucket may complete one fused tensor without its neighbours: it maps on its own
    alone = checkpoint_named(
        names, {"model.layers.1.mlp.experts.down_proj": meta["model.layers.1.mlp.experts.down_proj"]}
    )
    assert sorted(alone) == [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)]


def test_a_pushed_bucket_becomes_a_payload_the_workers_load(tiny_moe):
    """What load_weights ships to the workers: a safetensors bucket of checkpoint names that
    round-trips bitwise (converted experts are plain contiguous tensors, none sharing memory)."""
    from grpo_rollout.engines.vllm_engine import checkpoint_named
    from safetensors.torch import load, save
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_moe).state_dict()
    mapped = checkpoint_named(CheckpointNames(tiny_moe), dict(state))
    back = load(save(mapped))
    on_disk = load_file(str(tiny_moe / "model.safetensors"))
    assert set(back) == set(on_disk) and all(torch.equal(back[k], on_disk[k]) for k in on_disk)
