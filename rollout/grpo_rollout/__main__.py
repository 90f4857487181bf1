"""`python -m grpo_rollout serve`: the rollout pod's command (rendered by the operator, run locally too);
`python -m grpo_rollout headless`: a worker pod's, in a server spanning nodes (rollout.nodesPerServer > 1);
`python -m grpo_rollout reward`: a reward pod's (spec.reward.model), see `grpo_rollout.reward_model.command`.

Reads the run contract from $GRPO_CONTRACT (an s3:// model is fetched into the pod's model cache
first, `grpo_operator.storage`), this pod's index from $GRPO_POD_INDEX and the per-job
token from $GRPO_TOKEN; listens on this pod's endpoint port from the contract (--host/--port
override it for tests), on loopback only when that endpoint is a loopback address (the local
runtime), on every interface otherwise (a pod behind its Service). Exits 0 after a drain
(SIGTERM), non-zero with a clear message otherwise; `EXIT_ENGINE_DEAD` when the engine died, its
first error on stderr and in the pod's termination message (what `kubectl describe` and the
operator's pod verdict read); `EXIT_CONFIG` with a stated reason when the pod lacks what the resolved
layout needs (`grpo_rollout.preflight`: DeepEP, NCCL GIN's prerequisites, EFA's memlock limit), which
fails the job at once instead of restarting pods that cannot start.

In a server spanning nodes, `serve` (the leader pod) runs the first dataParallelSize / nodesPerServer
engines and hosts vLLM's data-parallel coordinator at $GRPO_DP_ADDRESS (its own IP); `headless` (each
worker pod) runs vLLM's headless mode with the next engines ($LWS_WORKER_INDEX), joining the leader at
$LWS_LEADER_ADDRESS. Both are set by the LeaderWorkerSet and the operator's pod templates.
"""

import argparse
import asyncio
import ipaddress
import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from grpo_operator import storage
from grpo_operator.api.contract import (
    ENV_CONTRACT,
    ENV_DP_ADDRESS,
    ENV_LEADER_ADDRESS,
    ENV_POD_INDEX,
    ENV_TOKEN,
    ENV_WORKER_INDEX,
    EXIT_CONFIG,
    GROUP_LINK_PORT,
    VLLM_DP_RPC_PORT,
    RunContract,
    write_termination_message,
)
from grpo_operator.api.spec import GRPOJobSpec
from grpo_wire.chat import ChatSettings

from grpo_rollout import preflight
from grpo_rollout.engines.base import EngineDead, engine_config
from grpo_rollout.reward_model import command as reward_command
from grpo_rollout.server import serve
from grpo_rollout.service import EnvironmentSettings, RolloutService, ServiceConfig, ToolSettings

EXIT_ENGINE_DEAD = 4  # the engine died: restart the pod (no other exit code of ours means this)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m grpo_rollout", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run a rollout server for the job in $GRPO_CONTRACT")
    h = sub.add_parser("headless", help="run a worker pod's engines of a server spanning nodes")
    for c in (s, h):
        c.add_argument(
            "--contract", default=os.environ.get(ENV_CONTRACT), help=f"job.json (default ${ENV_CONTRACT})"
        )
        c.add_argument("--pod-index", type=int, default=int(os.environ.get(ENV_POD_INDEX, "0")))
        c.add_argument("--device", default="auto", help="torch engine device: auto, cpu, cuda, cuda:N")
        c.add_argument("--dtype", default=None, help="override spec.model.dtype (e.g. float32 on CPU)")
        c.add_argument("--dp-rpc-port", type=int, default=VLLM_DP_RPC_PORT, help=argparse.SUPPRESS)  # tests
        c.add_argument("--group-link-port", type=int, default=GROUP_LINK_PORT, help=argparse.SUPPRESS)
        c.add_argument("--log-level", default="INFO")
    s.add_argument("--host", default=None, help="default: loopback for a loopback endpoint, else 0.0.0.0")
    s.add_argument("--port", type=int, default=None, help="default: this pod's endpoint port in the contract")
    s.add_argument("--drain-seconds", type=float, default=float(os.environ.get("GRPO_DRAIN_SECONDS", "25")))
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    h.add_argument("--worker-index", type=int, default=int(os.environ.get(ENV_WORKER_INDEX, "0")))
    h.add_argument("--leader-address", default=os.environ.get(ENV_LEADER_ADDRESS))
    r = sub.add_parser(
        "reward", help="serve the reward model (spec.reward.model) of the job in $GRPO_CONTRACT"
    )
    r.add_argument(
        "--contract", default=os.environ.get(ENV_CONTRACT), help=f"job.json (default ${ENV_CONTRACT})"
    )
    r.add_argument("--pod-index", type=int, default=int(os.environ.get(ENV_POD_INDEX, "0")))
    r.add_argument("--log-level", default="INFO")
    reward_command.add_arguments(r)
    return p.parse_args(argv)


def listen_host(endpoint: str | None) -> str:
    """Loopback endpoints (the local runtime) keep the server off the machine's other interfaces."""
    host = urlparse(endpoint).hostname if endpoint else None
    try:
        return host if host and ipaddress.ip_address(host).is_loopback else "0.0.0.0"
    except ValueError:
        return "0.0.0.0"


def service_config(contract: RunContract, args: argparse.Namespace) -> tuple[ServiceConfig, int]:
    spec = contract.spec
    try:  # an s3:// model is fetched once per pod into the node-local cache (spec.storage.cacheDir)
        model_path = storage.model_dir(spec.model.path, spec.storage.cache_dir)
    except (OSError, storage.StorageError) as e:
        raise SystemExit(f"rollout: cannot fetch the model {spec.model.path!r}: {e}") from None
    if not Path(model_path).is_dir():
        raise SystemExit(f"rollout: model directory {model_path!r} does not exist")
    endpoints = contract.rollout.endpoints
    endpoint_port = urlparse(endpoints[args.pod_index]).port if args.pod_index < len(endpoints) else None
    port = getattr(args, "port", None) or endpoint_port or contract.rollout.port
    common = dict(
        model_path=model_path,
        dtype=args.dtype or str(spec.model.dtype),
        device=args.device,
        max_batch_size=spec.rollout.max_batch_size,
        tensor_parallel_size=spec.rollout.tensor_parallel_size,
        seed=spec.algorithm.seed + args.pod_index,
    )
    engine = engine_config(str(spec.rollout.engine), spec, **common)
    if spec.rollout.spans_nodes and args.command == "serve":  # the leader of a server spanning nodes
        address = os.environ.get(ENV_DP_ADDRESS)
        if not address:
            raise SystemExit(
                f"rollout: spec.rollout.nodesPerServer is {spec.rollout.nodes_per_server} but "
                f"${ENV_DP_ADDRESS} (this pod's IP, where vLLM's data-parallel coordinator binds) is not set"
            )
        from grpo_rollout.engines import vllm_headless  # vLLM servers only

        engine = vllm_headless.spanning(engine, spec, address, args.dp_rpc_port, args.group_link_port)
    config = ServiceConfig(
        server_id=f"{contract.job_name}-rollout-{args.pod_index}",
        engine=str(spec.rollout.engine),
        engine_config=engine,
        reward=spec.reward,
        reward_endpoints=tuple(contract.reward.endpoints) if contract.reward is not None else (),
        reward_token=os.environ.get(ENV_TOKEN, ""),
        drain_seconds=getattr(args, "drain_seconds", 0.0),
        chat=ChatSettings.of(spec.dataset),
        tools=tool_settings(spec),
        environment=environment_settings(spec),
        max_turns=spec.rollout.max_turns,
    )
    return config, port


def headless(args: argparse.Namespace, contract: RunContract) -> int:
    """A worker pod of a server spanning nodes: vLLM's headless mode with this pod's engines, built
    from the same engine config as the leader's (`engines.vllm_headless`). It serves no HTTP."""
    spec = contract.spec
    if not spec.rollout.spans_nodes:
        raise SystemExit(
            "rollout: `headless` runs a worker pod of a server spanning nodes; "
            "spec.rollout.nodesPerServer is 1"
        )
    if not args.leader_address:
        raise SystemExit(
            f"rollout: no leader address: set ${ENV_LEADER_ADDRESS} (the LeaderWorkerSet does) "
            "or --leader-address"
        )
    nodes = spec.rollout.nodes_per_server
    if not 1 <= args.worker_index < nodes:
        raise SystemExit(
            f"rollout: worker index {args.worker_index} is not in 1..{nodes - 1} "
            f"(rollout.nodesPerServer {nodes})"
        )
    from grpo_rollout import group_link
    from grpo_rollout.engines import vllm_headless

    config, _ = service_config(contract, args)
    try:  # before any engine starts: the leader knows this pod from here on, and this pod its leader
        link = group_link.join(args.leader_address, args.group_link_port, args.worker_index)
    except TimeoutError as e:
        raise SystemExit(f"rollout: {e}") from None
    group_link.exit_with_leader(link)
    engine = vllm_headless.spanning(config.engine_config, spec, args.leader_address, args.dp_rpc_port)
    local = spec.rollout.data_parallel_local
    argv = vllm_headless.worker_argv(engine, args.worker_index * local, local)
    logging.getLogger("grpo_rollout").info(
        "headless engines %d..%d of %s: %s",
        args.worker_index * local,
        (args.worker_index + 1) * local - 1,
        config.server_id,
        argv,
    )
    vllm_headless.main(argv)
    return 0


def tool_settings(spec: GRPOJobSpec) -> ToolSettings | None:
    """spec.tools and the rollout's episode bounds; None without tools (single-turn)."""
    if not spec.tools:
        return None
    paths = tuple(str(t.builtin) if t.builtin is not None else str(t.function) for t in spec.tools)
    rollout = spec.rollout
    return ToolSettings(
        paths,
        parser=str(rollout.tool_call_parser),
        max_result_chars=rollout.max_tool_result_chars,
        timeout_s=spec.reward.timeout_seconds,
    )


def environment_settings(spec: GRPOJobSpec) -> EnvironmentSettings | None:
    """spec.environment, its calls bounded like the rewards'; None without one."""
    env = spec.environment
    if env is None:
        return None
    return EnvironmentSettings(
        env.class_path,
        dict(env.args),
        reward_weight=env.reward_weight,
        timeout_s=spec.reward.timeout_seconds,
        max_message_chars=spec.rollout.max_tool_result_chars,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.contract:
        raise SystemExit(f"rollout: no run contract; set ${ENV_CONTRACT} or pass --contract")
    token = os.environ.get(ENV_TOKEN)
    if not token and args.command in ("serve", "reward"):
        raise SystemExit(
            f"rollout: ${ENV_TOKEN} is not set; the per-job token guards /generate, /weights and /score"
        )
    contract = RunContract.model_validate_json(Path(args.contract).read_text())
    if args.command == "reward":
        return reward_command.run(args, contract, token, listen_host)
    if (stated := preflight.stated(contract.spec)) is not None:  # before vLLM: a reason, not a crash loop
        logging.getLogger("grpo_rollout").error("%s", stated)
        write_termination_message(stated, who="rollout")
        return EXIT_CONFIG
    if args.command == "headless":
        return headless(args, contract)
    config, port = service_config(contract, args)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    endpoints = contract.rollout.endpoints
    host = args.host or listen_host(endpoints[args.pod_index] if args.pod_index < len(endpoints) else None)
    try:
        asyncio.run(serve(RolloutService(config), token, host, port))
    except EngineDead as e:
        stated = f"EngineDead: {config.server_id}: the {config.engine} engine died: {e}"
        logging.getLogger("grpo_rollout").error("%s; exiting for a restart", stated)
        write_termination_message(stated, who="rollout")
        return EXIT_ENGINE_DEAD
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait for an engine thread mid-step: the drain already answered every request
