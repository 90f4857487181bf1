"""The run contract: the resolved job every pod reads from `job.json`.

The operator renders it (spec + topology) into a ConfigMap; in a cluster the addresses are
Service DNS names, under the local runtime they are loopback addresses. Trainer and
rollout processes read it through these models and nothing else; env vars only carry
what differs per pod (the pod index).
"""

import os
import sys

from pydantic import Field

from grpo_operator.api.base import ApiModel
from grpo_operator.api.spec import GRPOJobSpec

CONTRACT_VERSION = 1
CONTRACT_FILE = "job.json"
CONTRACT_MOUNT = "/etc/grpo"
ENV_CONTRACT = "GRPO_CONTRACT"
ENV_POD_INDEX = "GRPO_POD_INDEX"
ENV_TOKEN = "GRPO_TOKEN"
# A rollout server spanning nodes (rollout.nodesPerServer > 1): the leader pod's own address, where
# vLLM's data-parallel coordinator binds (ZMQ binds an IP, not a DNS name); its worker pods reach it
# at the LeaderWorkerSet's LWS_LEADER_ADDRESS and know their place from LWS_WORKER_INDEX.
ENV_DP_ADDRESS = "GRPO_DP_ADDRESS"
ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
ENV_WORKER_INDEX = "LWS_WORKER_INDEX"
# where the leader's vLLM data-parallel coordinator listens (ParallelConfig.data_parallel_rpc_port's
# default in vLLM 0.32.0, config/parallel.py:160), named here so leader and workers agree on it
VLLM_DP_RPC_PORT = 29550
# where the leader takes one TCP link from each worker pod, the group's liveness (grpo_rollout.group_link)
GROUP_LINK_PORT = 29551

# Exit codes of the trainer launcher, read by the operator and the local runtime alike.
EXIT_CONFIG = 3  # a configuration error no restart can fix (bad contract, bad dataset row)
EXIT_STOPPED = 143  # stopped by SIGTERM/SIGINT after saving a checkpoint (not finished)
# Errors a restart cannot fix fail the job at once instead of burning its backoff limit:
# EXIT_CONFIG, and sysexits' EX_USAGE, EX_DATAERR and EX_CONFIG for custom trainer images.
PERMANENT_EXIT_CODES = frozenset({EXIT_CONFIG, 64, 65, 78})
TERMINATION_LOG = "/dev/termination-log"  # the pod's default terminationMessagePath


def write_termination_message(text: str, who: str) -> None:
    """In a pod, say why the container ends where Kubernetes reads it (the operator states it in the
    job's status); elsewhere (the local runtime) the log carries the same line. `who` names the
    writer in the one line printed when the file cannot be written."""
    if "KUBERNETES_SERVICE_HOST" not in os.environ:
        return
    try:
        with open(TERMINATION_LOG, "w") as f:
            f.write(text[:4000])  # the kubelet keeps at most 4096 bytes
    except OSError as e:
        print(f"{who}: cannot write {TERMINATION_LOG}: {e}", file=sys.stderr)


class TrainerTopology(ApiModel):
    service: str = Field(description="service: headless Service of the trainer gang.")
    replicas: int = Field(ge=1, description="replicas: trainer pods.")
    processes_per_pod: int = Field(ge=1, description="processesPerPod: ranks per pod.")
    world_size: int = Field(ge=1, description="worldSize: replicas * processesPerPod.")
    expert_parallel_size: int = Field(ge=1, description="expertParallelSize: ranks in one EP group.")
    data_parallel_size: int = Field(ge=1, description="dataParallelSize: worldSize / expertParallelSize.")
    master_addr: str = Field(description="masterAddr: address of rank 0 (pod 0) for torch.distributed.")
    master_port: int = Field(ge=1, le=65535, description="masterPort: rendezvous port on rank 0.")
    backend: str = Field(description="backend: torch.distributed backend, nccl or gloo.")
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="metricsPort: optional. Rank 0 serves Prometheus /metrics on it (the pod's `metrics` "
        "port); unset: no exporter (the local runtime, unless asked).",
    )
    weight_sync_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="weightSyncPort: optional. Rank 0 hosts the weight-sync TCPStore on it (the collective "
        "transport: rollout servers join the trainer's groups there); unset: HTTP only.",
    )


class RolloutTopology(ApiModel):
    service: str = Field(description="service: headless Service of the rollout servers.")
    replicas: int = Field(ge=0, description="replicas: rollout servers at render time.")
    port: int = Field(ge=1, le=65535, description="port: HTTP port of each server.")
    endpoints: list[str] = Field(description="endpoints: base URL of each server, by pod index.")


class RewardTopology(ApiModel):
    service: str = Field(description="service: headless Service of the reward model servers.")
    replicas: int = Field(ge=0, description="replicas: reward model servers at render time.")
    port: int = Field(ge=1, le=65535, description="port: HTTP port of each server.")
    endpoints: list[str] = Field(description="endpoints: base URL of each server, by pod index.")


class RunContract(ApiModel):
    version: int = Field(default=CONTRACT_VERSION, description="version: contract format version.")
    job_name: str = Field(description="jobName: the GRPOJob's name.")
    namespace: str = Field(description="namespace: the GRPOJob's namespace.")
    generation: int = Field(default=1, description="generation: spec generation this contract was made from.")
    spec: GRPOJobSpec = Field(description="spec: the validated spec, defaults filled in.")
    trainer: TrainerTopology = Field(description="trainer: resolved trainer topology.")
    rollout: RolloutTopology = Field(description="rollout: resolved rollout topology.")
    reward: RewardTopology | None = Field(
        default=None, description="reward: the reward model servers (spec.reward.model), else absent."
    )
    checkpoint_dir: str = Field(
        description="checkpointDir: where this job's checkpoints live inside the pod."
    )
    status_url: str | None = Field(
        default=None,
        description="statusUrl: where rank 0 reports progress (a GRPOJob status endpoint or local).",
    )
