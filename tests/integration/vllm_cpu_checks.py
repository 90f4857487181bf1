"""Checks that need vLLM itself, run by test_vllm_engine_cpu.py under the vllm venv's python (the
main venv has no vllm): `signatures` pins every vLLM call the engine and its worker make;
`routing MODEL_DIR` starts our engine with routing replay and prints the refusal it raises.
A failed pin is an AssertionError naming the call and what changed."""

import inspect
import sys


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def signatures() -> None:
    import vllm
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsModular
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.model_loader import reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient

    pins = {
        "initialize_layerwise_reload": (params(reload.initialize_layerwise_reload), ["model"]),
        "finalize_layerwise_processing": (
            params(reload.finalize_layerwise_processing),
            ["model", "model_config"],
        ),
        "get_layerwise_info": (params(get_layerwise_info), ["layer"]),
        "AsyncLLM.collective_rpc": (
            params(AsyncLLM.collective_rpc),
            ["self", "method", "timeout", "args", "kwargs"],
        ),
        # the engine's `_rpc`: the utility "collective_rpc" on every engine (core.py:1073), positionally
        "AsyncMPClient.call_utility_all_async": (
            params(AsyncMPClient.call_utility_all_async),
            ["self", "method", "args"],
        ),
        "EngineCore.collective_rpc": (
            params(EngineCore.collective_rpc),
            ["self", "method", "timeout", "args", "kwargs"],
        ),
        "AsyncLLM.reset_prefix_cache": (
            params(AsyncLLM.reset_prefix_cache),
            ["self", "reset_running_requests", "reset_connector"],
        ),
        "AsyncLLM.sleep": (params(AsyncLLM.sleep), ["self", "level", "mode"]),
        "AsyncLLM.wake_up": (params(AsyncLLM.wake_up), ["self", "tags"]),
        "AsyncLLM.generate": (
            params(AsyncLLM.generate)[:4],
            ["self", "prompt", "sampling_params", "request_id"],
        ),
        "FusedMoEExpertsModular.process_weights_after_loading": (
            params(FusedMoEExpertsModular.process_weights_after_loading),
            ["self", "layer"],
        ),
    }
    # the DP client answers call_utility_async with engine 0 only; it must not narrow the "all" call
    assert DPLBAsyncMPClient.call_utility_all_async is AsyncMPClient.call_utility_all_async
    for name, (got, want) in pins.items():
        assert got == want, f"vLLM {vllm.__version__}: {name} takes {got}, the engine calls it with {want}"
    # finalize_layerwise_reload forwards *args/**kwargs to finalize_layerwise_processing
    assert params(reload.finalize_layerwise_reload) == ["args", "kwargs"], params(
        reload.finalize_layerwise_reload
    )
    fields = set(LayerReloadingInfo.__dataclass_fields__)
    assert {"load_numel", "load_numel_total", "kernel_tensors", "loaded_weights"} <= fields, fields
    written_pins()
    assert hasattr(UnquantizedFusedMoEMethod, "_setup_kernel")  # where the repack is skipped on reload
    sampling = set(inspect.signature(vllm.SamplingParams).parameters)
    want = {"n", "temperature", "top_p", "max_tokens", "logprobs", "seed", "output_kind"}
    assert want <= sampling, f"SamplingParams lacks {want - sampling}"
    engine_args = set(inspect.signature(vllm.AsyncEngineArgs).parameters)
    want = {
        "model", "dtype", "tensor_parallel_size", "data_parallel_size", "enable_expert_parallel",
        "gpu_memory_utilization", "enforce_eager", "seed", "max_num_seqs", "logprobs_mode",
        "worker_extension_cls", "enable_sleep_mode", "disable_log_stats", "max_model_len",
        "enable_return_routed_experts", "enable_prefix_caching", "all2all_backend",
    }  # fmt: skip
    assert want <= engine_args, f"AsyncEngineArgs lacks {want - engine_args}"
    all2all_backends()
    expert_placements()
    own_expert_maps()
    pod_arguments()
    # what `vllm_stream.held_experts` reads of a worker's config to know its experts
    from vllm.config.model import ModelConfig
    from vllm.config.parallel import ParallelConfig

    def lacks(cls: type, names: tuple[str, ...]) -> list[str]:
        return [n for n in names if not hasattr(cls, n) and n not in cls.__dataclass_fields__]

    parallel = ("enable_expert_parallel", "enable_eplb", "expert_placement_strategy", "rank")
    parallel += ("pipeline_parallel_size", "tensor_parallel_size", "data_parallel_size")
    parallel += ("data_parallel_index", "world_size")
    missing = lacks(ParallelConfig, parallel) + lacks(ModelConfig, ("hf_text_config",))
    assert not missing, f"vLLM {vllm.__version__}: the configs lack {missing}"
    print(f"vllm {vllm.__version__}: {len(pins) + 7} pins hold")


def written_pins() -> None:
    """What `vllm_worker` reads to know which parameters a version wrote (`vllm_written`) and the
    sleep state the engine checks after every update."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader import default_loader
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    from vllm.v1.engine.async_llm import AsyncLLM

    assert default_loader._CONFIG_BUILT_PARAMS == ("input_scale_ub",), default_loader._CONFIG_BUILT_PARAMS
    assert "e_score_correction_bias" in SKIP_LOAD_TENSORS, SKIP_LOAD_TENSORS
    assert issubclass(ParallelLMHead, VocabParallelEmbedding) and isinstance(BaseKVCacheMethod, type)
    assert params(AsyncLLM.is_sleeping) == ["self"], params(AsyncLLM.is_sleeping)
    # the first load's own check: every named parameter written, by load_weights' names
    source = inspect.getsource(default_loader.DefaultModelLoader.track_weights_loading)
    assert "weights_to_load - loaded_weights" in source, source


def expert_placements() -> None:
    """The trainer sends an EP worker the experts `grpo_wire.holdings.expert_placement` says it holds:
    exactly those vLLM's own `determine_expert_map` gives its EP rank, for both strategies."""
    from typing import get_args

    from grpo_wire.holdings import PLACEMENTS, expert_placement
    from vllm.model_executor.layers.fused_moe.expert_map_manager import (
        ExpertPlacementStrategy,
        determine_expert_map,
    )

    assert set(PLACEMENTS) == set(get_args(ExpertPlacementStrategy)), get_args(ExpertPlacementStrategy)
    for strategy in PLACEMENTS:
        for experts, ep in ((8, 2), (8, 3), (128, 8), (256, 32), (60, 7)):
            for rank in range(ep):
                _, expert_map, _ = determine_expert_map(ep, rank, experts, strategy)
                theirs = [e for e in range(experts) if int(expert_map[e]) >= 0]
                ours = expert_placement(rank, ep, experts, strategy)
                assert ours == theirs, (strategy, experts, ep, rank, ours, theirs)


def own_expert_maps() -> None:
    """A worker sends the trainer the experts its own layers keep (`vllm_stream.experts_in_model`):
    vLLM's real ExpertMapManager for each EP rank, held as RoutedExperts holds it, read back as vLLM
    placed them. Where vLLM overrides the configured strategy (round_robin without expert groups falls
    back to linear, expert_map_manager.py:123-136) the model's map is what counts, and the config's
    placement would have sent the wrong rows."""
    import torch
    from grpo_rollout.engines.vllm_stream import experts_in_model
    from grpo_wire.holdings import expert_placement
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    def layer(ep: int, rank: int, experts: int, strategy: str, groups: int | None) -> torch.nn.Module:
        parallel = FusedMoEParallelConfig(
            tp_size=1, pcp_size=1, dp_size=ep, ep_size=ep, tp_rank=0, pcp_rank=0, dp_rank=rank, ep_rank=rank,
            sp_size=1, use_ep=True, all2all_backend="deepep_low_latency", enable_eplb=False,
        )  # fmt: skip
        module = torch.nn.Module()
        module.expert_map_manager = ExpertMapManager(  # type: ignore[assignment]
            max_num_batched_tokens=64, top_k=2, global_num_experts=experts, num_redundant_experts=0,
            num_expert_group=groups, moe_parallel_config=parallel, placement_strategy=strategy,
            enable_eplb=False,
        )  # fmt: skip
        return module

    for experts, ep in ((8, 2), (128, 8), (60, 7)):
        for rank in range(ep):
            for strategy, groups, placed in (
                ("linear", None, "linear"),
                (
                    "round_robin",
                    4 if experts % 4 == 0 else None,
                    "round_robin" if experts % 4 == 0 else "linear",
                ),
                ("round_robin", None, "linear"),  # vLLM's fallback
            ):
                model = torch.nn.Sequential(
                    layer(ep, rank, experts, strategy, groups), layer(ep, rank, experts, strategy, groups)
                )
                ours = experts_in_model(model)
                assert ours == expert_placement(rank, ep, experts, placed), (
                    experts,
                    ep,
                    rank,
                    strategy,
                    ours,
                )
    mixed = torch.nn.Sequential(layer(2, 0, 8, "linear", None), layer(2, 1, 8, "linear", None))
    try:
        experts_in_model(mixed)
    except ValueError as e:
        assert "place experts differently" in str(e), e
    else:
        raise AssertionError("layers placing experts differently were not refused")
    assert experts_in_model(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


def pod_arguments() -> None:
    """The pods of a server spanning nodes, as the operator renders them for the seed's example
    (examples/p5en-deepseek-v3.yaml: 4 p5en per server, TP 1 x DP 32 x EP 32): the leader's engine
    arguments are `AsyncEngineArgs` fields, and each worker's headless argv, parsed by vLLM's own
    `serve` parser and turned into `AsyncEngineArgs` as `vllm serve --headless` does, is the same engine
    with its own 8 engines from 8 x its worker index, joining the leader on the DP RPC port."""
    import dataclasses
    import shutil
    import tempfile
    from pathlib import Path

    import yaml
    from grpo_operator.api.contract import VLLM_DP_RPC_PORT
    from grpo_operator.api.job import GRPOJob
    from grpo_rollout.engines import vllm_headless
    from grpo_rollout.engines.vllm_engine import VllmEngineConfig, engine_args, vllm_options
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = Path(__file__).resolve().parents[2]
    spec = GRPOJob.model_validate(
        yaml.safe_load((root / "examples" / "p5en-deepseek-v3.yaml").read_text())
    ).spec
    model = tempfile.mkdtemp(prefix="dsv3-")  # the config alone: vLLM resolves a local model folder
    shutil.copy(root / "tests" / "data" / "model-configs" / "deepseek-v3.config.json", f"{model}/config.json")
    config = VllmEngineConfig(model_path=model, tensor_parallel_size=1, vllm=vllm_options(spec))
    leader = vllm_headless.spanning(config, spec, "10.0.0.5", VLLM_DP_RPC_PORT)
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    args = engine_args(leader, 141 << 30)
    assert set(args) <= fields, f"not AsyncEngineArgs fields: {set(args) - fields}"
    AsyncEngineArgs(**args)
    assert (args["data_parallel_size"], args["data_parallel_size_local"]) == (32, 8), args
    assert args["enable_expert_parallel"] and args["all2all_backend"] == "deepep_v2", args
    leader_dns = "deepseek-v3-p5en-rollout-0.deepseek-v3-p5en-rollout.ml"  # LWS_LEADER_ADDRESS
    worker = vllm_headless.spanning(config, spec, leader_dns, VLLM_DP_RPC_PORT)
    for index in (1, 2, 3):
        argv = vllm_headless.headless_argv(engine_args(worker, 141 << 30), 8 * index, 8)
        parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        assert parsed.headless and parsed.model_tag == model, argv
        parsed.model = parsed.model_tag
        got = AsyncEngineArgs.from_cli_args(parsed)
        same = ("tensor_parallel_size", "data_parallel_size", "enable_expert_parallel", "all2all_backend",
                "gpu_memory_utilization", "max_model_len", "max_num_seqs", "worker_extension_cls",
                "seed")  # fmt: skip
        assert {k: getattr(got, k) for k in same} == {k: args[k] for k in same}, (got, args)
        assert (got.data_parallel_size_local, got.data_parallel_start_rank) == (8, 8 * index)
        assert got.data_parallel_address == leader_dns
        assert got.data_parallel_rpc_port == VLLM_DP_RPC_PORT


def all2all_backends() -> None:
    """spec.rollout.vllm.all2allBackend offers exactly what this vLLM's `All2AllBackend` holds, less
    the names it left out on purpose (VllmAll2AllBackend's docstring says why), and vLLM's own CLI
    parser takes each of them as --all2all-backend."""
    from typing import get_args

    from grpo_operator.api.roles import VllmAll2AllBackend
    from vllm.config.parallel import All2AllBackend
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllms = set(get_args(All2AllBackend))
    left_out = {"naive", "pplx", "passthrough", "flashinfer_all2allv"}
    assert left_out <= vllms, f"vLLM dropped {left_out - vllms}: take them out of the left-out list"
    offered = {m.value for m in VllmAll2AllBackend} - {"auto"}
    assert offered == vllms - left_out, f"API offers {sorted(offered)}, vLLM has {sorted(vllms - left_out)}"
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    for name in sorted(offered):
        assert parser.parse_args(["--all2all-backend", name]).all2all_backend == name, name


def routing(model_dir: str) -> None:
    from grpo_rollout.engines.vllm_engine import VllmEngine, VllmEngineConfig, VllmOptions

    try:
        VllmEngine(VllmEngineConfig(model_path=model_dir, vllm=VllmOptions(routed_experts=True)))
    except RuntimeError as e:
        print(f"refused: {e}")
        return
    raise AssertionError("the vllm engine started with routing replay on CPU")


def abort(model_dir: str) -> None:
    """Abort an update twice in one real engine: after part of one layer (its old tensors must
    stay: the same samples) and after one whole layer (new weights in place: refused)."""
    import json

    from grpo_rollout.engines.vllm_engine import VllmEngine, VllmEngineConfig, VllmOptions
    from grpo_wire.protocol import Sampling
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    shapes = {k: list(v.shape) for k, v in state.items()}
    opts = VllmOptions(enforce_eager=True, max_model_len=256)
    engine = VllmEngine(VllmEngineConfig(model_path=model_dir, dtype="float32", vllm=opts))
    sampling = Sampling(temperature=1.0, max_new_tokens=8, seed=5)

    def samples() -> list:
        out = engine.generate(["1+2="], 4, sampling, lambda: False)
        return [(s.token_ids, s.logprobs) for s in out[0].samples]  # type: ignore[union-attr]

    before = samples()
    q = "model.layers.0.self_attn.q_proj.weight"  # vLLM's qkv layer also waits for k and v
    engine.begin_update(shapes)
    engine.load_bucket([(q, 0, (state[q] + 1.0).flatten())])
    engine.abort_update()
    report = {"partial_same": samples() == before, "partial_torn": engine.torn}
    engine.begin_update(shapes)
    engine.load_bucket([("model.norm.weight", 0, (state["model.norm.weight"] * 2).flatten())])
    engine.abort_update()
    report["whole_torn"] = engine.torn
    try:
        samples()
        report["refused"] = False
    except RuntimeError:
        report["refused"] = True
    engine.llm.shutdown()
    print(json.dumps(report))


def headless(model_dir: str) -> None:
    """A server whose two data-parallel engines run in two processes: ours (the leader, engine 0)
    and a headless one (`engines.vllm_headless`, engine 1) that joins it. Both engines' workers
    answer the leader's RPCs, so both are weight-stream members: a version streamed by a trainer
    rank goes live on both (the headless engine's worker joins the group and loads it), and both
    then sample from the new weights."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import threading

    import torch
    from grpo_rollout.engines.vllm_engine import VllmEngine, VllmEngineConfig, VllmOptions, engine_args
    from grpo_rollout.engines.vllm_headless import headless_argv
    from grpo_trainer.weight_sync import StreamSender
    from grpo_wire.protocol import Sampling, WeightStreamRequest
    from transformers import AutoModelForCausalLM

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    opts = VllmOptions(
        enforce_eager=True, max_model_len=256, data_parallel_size=2, gpu_memory_utilization=0.2,
        data_parallel_size_local=1, data_parallel_address="127.0.0.1", data_parallel_rpc_port=free_port(),
    )  # fmt: skip
    config = VllmEngineConfig(model_path=model_dir, dtype="float32", vllm=opts)
    argv = headless_argv(engine_args(config), start_rank=1, size_local=1)
    # a session of its own: its engine core and workers are its children, and all of them go with it
    worker = subprocess.Popen(
        [sys.executable, "-m", "grpo_rollout.engines.vllm_headless", *argv], start_new_session=True
    )
    report: dict = {}
    try:
        engine = VllmEngine(config)
        report["members"] = sorted(engine._rpc("grpo_stream_member"))
        sampling = Sampling(temperature=1.0, max_new_tokens=6, seed=3)  # seeded: the same draws
        before = [s.token_ids for r in engine.generate(["1+2=", "3+4="], 2, sampling, lambda: False)
                  for s in r.samples]  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        state = {k: (v + 0.5 * torch.randn_like(v)).reshape(-1) for k, v in model.state_dict().items()}
        sender = StreamSender("127.0.0.1", free_port(), 0, timeout_s=120)
        request = WeightStreamRequest(
            version=1, epoch=1, store_host="127.0.0.1", store_port=sender.port, backend="gloo",
            feeders=1, members=engine.stream_members, first_member=0, timeout_s=120,
            tensors={k: list(v.shape) for k, v in model.state_dict().items()},
        )  # fmt: skip
        items = [(k, 0, v) for k, v in state.items()]
        send = threading.Thread(
            target=lambda: sender.send(iter(items), epoch=1, members=engine.stream_members, backend="gloo",
                                       dtype=torch.float32, bucket_bytes=1 << 20, device=torch.device("cpu"))
        )  # fmt: skip
        send.start()
        outcome = engine.receive_stream(request, refused=False)
        send.join(120)
        report["outcome"] = outcome.kind
        after = [s.token_ids for r in engine.generate(["1+2=", "3+4="], 2, sampling, lambda: False)
                 for s in r.samples]  # fmt: skip
        report["changed"] = before != after
        report["stream_members"] = engine.stream_members
        engine.llm.shutdown()
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    print(json.dumps(report))


if __name__ == "__main__":
    commands = {"signatures": signatures, "routing": routing, "abort": abort, "headless": headless}
    commands[sys.argv[1]](*sys.argv[2:])
