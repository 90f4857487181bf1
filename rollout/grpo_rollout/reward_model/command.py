"""`python -m grpo_rollout reward`: a reward pod's command (spec.reward.model), rendered by the operator.

Reads the run contract ($GRPO_CONTRACT), this pod's index ($GRPO_POD_INDEX) and the job's token
($GRPO_TOKEN, the rollout servers' too); fetches an s3:// model into the pod's cache like the rollout
does; listens on this pod's endpoint port from contract.reward (--host/--port override it), on loopback
only for a loopback endpoint. Exits 0 after SIGTERM, non-zero with the reason (also the pod's
termination message) when the model cannot load or is misconfigured.
"""

import argparse
import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from grpo_operator import storage
from grpo_operator.api.contract import EXIT_CONFIG, RunContract, write_termination_message
from grpo_operator.api.status import Reason
from grpo_operator.storage.check import POD_CREDENTIALS, Expect, PathError, check

from grpo_rollout.reward_model.base import LoadConfig, Misconfigured
from grpo_rollout.reward_model.server import RewardService, serve

log = logging.getLogger("grpo_rollout.reward")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="default: loopback for a loopback endpoint, else 0.0.0.0")
    p.add_argument("--port", type=int, default=None, help="default: this pod's endpoint port in the contract")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=None, help="default spec.model.dtype (e.g. float32 on CPU)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--drain-seconds", type=float, default=20.0)


def service_for(
    contract: RunContract, pod_index: int, args: argparse.Namespace
) -> tuple[RewardService, str | None, int]:
    """The service, this pod's endpoint and its port; SystemExit naming what is missing."""
    spec = contract.spec
    model = spec.reward.model
    if model is None:
        raise SystemExit("reward: spec.reward.model is not set; this job has no reward model to serve")
    # The trainer's rule for its own model (grpo_trainer.inputs), with this pod's mounts and credentials:
    # a path that holds no model fails the job naming the field, not pods restarting behind it.
    check("spec.reward.model.path", model.path, Expect.MODEL, credentials=POD_CREDENTIALS)
    try:  # an s3:// model is fetched once per pod into the node-local cache, like the rollout's
        path = storage.model_dir(model.path, spec.storage.cache_dir)
    except (OSError, storage.StorageError) as e:
        raise SystemExit(f"reward: cannot fetch spec.reward.model.path {model.path!r}: {e}") from None
    if not Path(path).is_dir():
        raise SystemExit(f"reward: spec.reward.model.path {path!r} is not a directory")
    endpoints = contract.reward.endpoints if contract.reward is not None else []
    endpoint = endpoints[pod_index] if pod_index < len(endpoints) else None
    port = args.port or (urlparse(endpoint).port if endpoint else None)
    port = port or (contract.reward.port if contract.reward is not None else None)
    if port is None:
        raise SystemExit(
            "reward: no port: the contract has no reward endpoints (contract.reward); pass --port"
        )
    config = LoadConfig(path=path, device=args.device, dtype=args.dtype or str(spec.model.dtype))
    service = RewardService(f"{contract.job_name}-reward-{pod_index}", str(model.kind), config, model)
    return service, endpoint, port


def run(
    args: argparse.Namespace, contract: RunContract, token: str, host_for: Callable[[str | None], str]
) -> int:
    """Serve until SIGTERM; `host_for(endpoint)` picks the listen address (the rollout's rule). A model
    that cannot serve as configured exits EXIT_CONFIG stating the reason the job then fails with."""
    who = f"{contract.job_name}-reward-{args.pod_index}"
    try:
        service, endpoint, port = service_for(contract, args.pod_index, args)
    except PathError as e:
        return stated_exit(f"{e.reason}: {who}: {e}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        asyncio.run(serve(service, token, args.host or host_for(endpoint), port, args.drain_seconds))
    except Misconfigured as e:
        return stated_exit(f"{Reason.REWARD_MODEL_MISCONFIGURED}: {service.server_id}: {e}")
    return 0


def stated_exit(stated: str) -> int:
    """Log `stated` ("<Reason>: <pod>: <why>") and make it the container's termination message, which
    the operator fails the job with; EXIT_CONFIG."""
    log.error("%s", stated)
    write_termination_message(stated, who="reward")
    return EXIT_CONFIG
