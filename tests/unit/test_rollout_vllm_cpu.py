"""What `spec.rollout.vllm` means on vLLM's CPU build (`grpo_rollout.engines.vllm_cpu`): the head
widths CPU attention takes, and a KV cache sized to the job instead of 0.9 of the machine's RAM."""

import pytest
from grpo_rollout.engines import vllm_cpu

# vllm 0.32 `CPUAttentionBackend.get_supported_head_sizes` (v1/attention/backends/cpu_attn.py:69)
CPU_HEADS = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]
TINY = {  # the demo's tiny model (grpo_trainer.tiny_model), head_dim 32
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 32,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
}


def test_head_widths_cpu_attention_refuses_are_named_with_the_fix() -> None:
    assert vllm_cpu.head_dim_refusal(TINY, CPU_HEADS) is None
    refusal = vllm_cpu.head_dim_refusal({**TINY, "head_dim": 16}, CPU_HEADS)
    assert refusal is not None and "head_dim 16" in refusal and "--head-dim 32" in refusal


def test_the_kv_cache_is_what_the_job_can_use_and_the_memory_share_bounds_it() -> None:
    per_token = 2 * 2 * 2 * 32 * 4  # layers x (k, v) x kv heads x head_dim x fp32
    need = vllm_cpu.kv_cache_bytes(
        TINY, dtype="float32", max_batch=256, max_model_len=128, tensor_parallel=1,
        memory_utilization=0.9, available=4 << 30,
    )  # fmt: skip
    assert need == max(per_token * 256 * 128, vllm_cpu.MIN_KV_BYTES)
    with pytest.raises(ValueError, match=r"spec\.rollout\.vllm\.gpuMemoryUtilization 0\.5"):
        vllm_cpu.kv_cache_bytes(
            TINY, dtype="float32", max_batch=256, max_model_len=None, tensor_parallel=1,
            memory_utilization=0.5, available=100 << 20,
        )  # fmt: skip


def test_tensor_parallel_cpu_workers_get_equal_consecutive_cpu_shares():
    """vLLM's own binding wants a NUMA node per worker; a one-socket machine has one."""
    assert vllm_cpu.thread_binding(2, [1, 0]) == "0|1"
    assert vllm_cpu.thread_binding(2, range(8)) == "0,1,2,3|4,5,6,7"
    assert vllm_cpu.thread_binding(3, range(7)) == "0,1|2,3|4,5"  # the odd CPU left idle
    with pytest.raises(ValueError, match="2 tensor-parallel workers need at least 2 CPUs"):
        vllm_cpu.thread_binding(2, [0])


def test_a_reward_models_head_width_refusal_names_its_own_field():
    refusal = vllm_cpu.head_dim_refusal({**TINY, "head_dim": 16}, CPU_HEADS, field="spec.reward.model.path")
    assert refusal is not None and refusal.startswith("spec.reward.model.path: head_dim 16")


def test_reward_inputs_past_the_engines_limit_are_set_aside_with_the_reason():
    """vLLM refuses a prompt past max_model_len for the whole batch; the reward server scores it 0."""
    from grpo_rollout.reward_model.vllm_engine import fitting

    keep, errors = fitting([[1] * 10, [1] * 30, [1] * 20], limit=24, reserve=4)
    assert keep == [0, 2]  # 20 + 4 fits exactly
    assert errors[0] is None and errors[2] is None
    assert errors[1] == (
        "input of 30 tokens + 4 for the judgement is over the 24 the reward server takes "
        "(spec.reward.model.maxModelLen, default the model's context)"
    )
    assert fitting([[1] * 25], limit=24) == (
        [],
        [errors[1].replace(" + 4 for the judgement", "").replace("30", "25")],
    )


def test_reward_engine_arguments_follow_the_spec():
    from grpo_operator.api.spec import RewardModelSpec
    from grpo_rollout.reward_model.base import LoadConfig
    from grpo_rollout.reward_model.vllm_engine import engine_args

    spec = RewardModelSpec.model_validate(
        {"path": "/rm", "engine": "vllm", "tensorParallelSize": 4, "maxModelLen": 8192, "batchSize": 32}
    )
    args = engine_args(LoadConfig("/rm", "auto", "bfloat16"), spec, pooling=True)
    assert args | {"model": "/rm"} == {
        "model": "/rm", "dtype": "bfloat16", "tensor_parallel_size": 4, "max_num_seqs": 32, "seed": 0,
        "disable_log_stats": True, "max_model_len": 8192, "runner": "pooling",
    }  # fmt: skip
    with pytest.raises(ValueError, match="the vllm engine picks its devices"):
        engine_args(LoadConfig("/rm", "cuda:1"), spec, pooling=False)
