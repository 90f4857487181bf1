"""The run contract: a GRPOJob spec plus its resolved topology (api/contract.py models).

Called by `render.children` (the ConfigMap's job.json) and by the local runtime with
`LocalPorts`, so both run the same contract; only the addresses differ (Service DNS names
in a cluster, 127.0.0.1 ports on one machine).
"""

from dataclasses import dataclass

from grpo_operator.api.contract import RewardTopology, RolloutTopology, RunContract, TrainerTopology
from grpo_operator.api.job import API_VERSION, PLURAL, GRPOJob
from grpo_operator.api.roles import resolve_all2all
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.instance_types import InstanceTable, UnknownInstanceType
from grpo_operator.instance_types import load as load_instance_types
from grpo_operator.render import names, storage


class RenderError(ValueError):
    """The job cannot be rendered (bad instance type, EFA mismatch, name too long...).

    The operator turns it into a Failed condition with this message; the CLI prints it.
    """


@dataclass(frozen=True)
class LocalPorts:
    """Loopback ports for the local runtime: rank 0's rendezvous, one per rollout server and one per
    reward model server (spec.reward.model)."""

    trainer_master_port: int
    rollout_ports: tuple[int, ...]
    trainer_metrics_port: int | None = None  # rank 0's /metrics; None: no exporter
    weight_sync_port: int | None = None  # rank 0's weight-sync store; None: weights over HTTP only
    reward_ports: tuple[int, ...] = ()


def check_name(name: str, *, spans_nodes: bool = False) -> None:
    if len(name) > names.MAX_JOB_NAME:
        raise RenderError(
            f"job name {name!r} has {len(name)} characters; at most {names.MAX_JOB_NAME} fit the "
            "StatefulSet pod labels"
        )
    if spans_nodes and len(name) > names.MAX_GROUPED_JOB_NAME:
        raise RenderError(
            f"job name {name!r} has {len(name)} characters; with rollout.nodesPerServer above 1 at most "
            f"{names.MAX_GROUPED_JOB_NAME} fit the labels of the LeaderWorkerSet's per-server StatefulSets"
        )


def trainer_gpus(job: GRPOJob, table: InstanceTable) -> int:
    """GPUs of one trainer node (0 for CPU pods); raises RenderError for unknown types."""
    itype = job.spec.trainer.instance_type
    if itype is None:
        return 0
    try:
        return table.get(itype).gpus
    except UnknownInstanceType as e:
        raise RenderError(f"trainer.instanceType: {e}") from None


def check_ep_backend(job: GRPOJob, backend: str) -> None:
    """An epBackend the gang's device cannot run (nccl or deepep without GPUs, gloo on GPUs): refused
    naming the field. The CEL rule sees only whether an instanceType is set; here the table says
    whether it has GPUs (m7i, c7i have none)."""
    trainer = job.spec.trainer
    wanted = str(trainer.ep_backend)
    needs = {"nccl": "nccl", "gloo": "gloo", "deepep": "nccl"}.get(wanted)
    if needs is None or needs == backend:
        return
    nodes = f"instanceType {trainer.instance_type}" if trainer.instance_type else "no instanceType"
    what = "DeepEP on GPUs" if wanted == "deepep" else f"the all-to-all on the gang's {wanted} group"
    raise RenderError(
        f"trainer.epBackend {wanted} runs {what}, but this gang runs {backend} ({nodes}): "
        f"set epBackend {backend} or auto"
    )


def check_all2all(job: GRPOJob, table: InstanceTable) -> None:
    """deepep_v2 on rollout nodes that have no EFA: refused naming the field (a layout rule needing the
    instance table, so here rather than in CEL)."""
    rollout = job.spec.rollout
    if resolve_all2all(rollout) != "deepep_v2":
        return
    itype = rollout.instance_type
    try:
        efa = table.get(itype).efa if itype else 0
    except UnknownInstanceType as e:
        raise RenderError(f"rollout.instanceType: {e}") from None
    if not efa:
        raise RenderError(
            f"rollout.vllm.all2allBackend deepep_v2 runs DeepEP v2 over NCCL GIN through EFA, but "
            f"{f'rollout.instanceType {itype}' if itype else 'no rollout.instanceType'} has no EFA devices: "
            "set allgather_reducescatter or auto"
        )


def contract(
    job: GRPOJob,
    *,
    name: str,
    namespace: str,
    generation: int = 1,
    uid: str | None = None,
    local_ports: LocalPorts | None = None,
    instance_types: InstanceTable | None = None,
    rollout_replicas: int | None = None,
) -> RunContract:
    """Resolve `job` into the contract every pod reads. Pure; raises RenderError.
    `rollout_replicas`: the servers running (autoscaled, or capped by Kueue), else spec's count.
    `uid` (the GRPOJob's, or the local runtime's run id) keys the checkpoint folder, so a job
    recreated under the same name never resumes its predecessor's saves."""
    check_name(name, spans_nodes=job.spec.rollout.spans_nodes)
    table = instance_types or load_instance_types()
    spec = job.spec
    trainer, rollout = spec.trainer, spec.rollout
    world = trainer.replicas * trainer.processes_per_pod
    backend = "nccl" if trainer_gpus(job, table) > 0 else "gloo"
    check_ep_backend(job, backend)
    check_all2all(job, table)
    if local_ports is not None:
        if len(local_ports.rollout_ports) != rollout.replicas:
            raise RenderError(
                f"local_ports has {len(local_ports.rollout_ports)} rollout ports for "
                f"{rollout.replicas} rollout replicas"
            )
        master_addr, master_port = "127.0.0.1", local_ports.trainer_master_port
        metrics_port = local_ports.trainer_metrics_port
        sync_port = local_ports.weight_sync_port
        endpoints = [f"http://127.0.0.1:{p}" for p in local_ports.rollout_ports]
        rollout_port = local_ports.rollout_ports[0] if local_ports.rollout_ports else names.ROLLOUT_PORT
        resolved_spec, status_url = spec, None
        reward = _reward(job, name, namespace, local_ports.reward_ports)
    else:
        master_addr = names.pod_dns(name, names.ROLE_TRAINER, 0, namespace)
        master_port, rollout_port = names.TRAINER_PORT, names.ROLLOUT_PORT
        metrics_port = names.TRAINER_METRICS_PORT
        sync_port = names.WEIGHT_SYNC_PORT
        endpoints = [
            f"http://{names.pod_dns(name, names.ROLE_ROLLOUT, i, namespace)}:{rollout_port}"
            for i in range(rollout.replicas if rollout_replicas is None else rollout_replicas)
        ]
        resolved_spec = _resolve_paths(job)
        status_url = (
            f"https://kubernetes.default.svc/apis/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        )
        reward = _reward(job, name, namespace)
    return RunContract(
        job_name=name,
        namespace=namespace,
        generation=generation,
        spec=resolved_spec,
        trainer=TrainerTopology(
            service=names.service_dns(name, names.ROLE_TRAINER, namespace),
            replicas=trainer.replicas,
            processes_per_pod=trainer.processes_per_pod,
            world_size=world,
            expert_parallel_size=trainer.expert_parallel_size,
            data_parallel_size=world // trainer.expert_parallel_size,
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            metrics_port=metrics_port,
            weight_sync_port=sync_port,
        ),
        rollout=RolloutTopology(
            service=names.service_dns(name, names.ROLE_ROLLOUT, namespace),
            replicas=len(endpoints),
            port=rollout_port,
            endpoints=endpoints,
        ),
        reward=reward,
        checkpoint_dir=checkpoint_dir(resolved_spec.checkpoint.path, namespace=namespace, name=name, uid=uid),
        status_url=status_url,
    )


def _reward(
    job: GRPOJob, name: str, namespace: str, local_ports: tuple[int, ...] | None = None
) -> RewardTopology | None:
    """The reward model servers (None without spec.reward.model): by pod DNS name behind their headless
    Service, or on the loopback `local_ports`, one per replica."""
    model = job.spec.reward.model
    if model is None:
        return None
    if local_ports is None:
        port = names.REWARD_PORT
        endpoints = [
            f"http://{names.pod_dns(name, names.ROLE_REWARD, i, namespace)}:{port}"
            for i in range(model.replicas)
        ]
    elif len(local_ports) != model.replicas:
        raise RenderError(
            f"local_ports has {len(local_ports)} reward ports for {model.replicas} reward.model.replicas"
        )
    else:
        port, endpoints = local_ports[0], [f"http://127.0.0.1:{p}" for p in local_ports]
    return RewardTopology(
        service=names.service_dns(name, names.ROLE_REWARD, namespace),
        replicas=model.replicas,
        port=port,
        endpoints=endpoints,
    )


def checkpoint_dir(root: str, *, namespace: str, name: str, uid: str | None) -> str:
    """This job's checkpoint folder: `<root>/<namespace>/<name>-<uid>` (without a uid, `<name>`)."""
    return f"{root.rstrip('/')}/{namespace}/{name}-{uid}" if uid else f"{root.rstrip('/')}/{namespace}/{name}"


def _resolve_paths(job: GRPOJob) -> GRPOJobSpec:
    """A copy of the spec with every `pvc://` URI replaced by its in-pod mount path."""
    spec = job.spec
    model = spec.model.model_copy(
        update={
            "path": storage.resolve(spec.model.path),
            "reference_path": storage.resolve(spec.model.reference_path)
            if spec.model.reference_path
            else None,
        }
    )
    held_out = spec.dataset.eval
    if held_out is not None:
        held_out = held_out.model_copy(update={"path": storage.resolve(held_out.path)})
    dataset = spec.dataset.model_copy(update={"path": storage.resolve(spec.dataset.path), "eval": held_out})
    resume_from = spec.checkpoint.resume_from
    checkpoint = spec.checkpoint.model_copy(
        update={
            "path": storage.resolve(spec.checkpoint.path),
            "resume_from": storage.resolve(resume_from) if resume_from else None,
        }
    )
    tracking = spec.tracking
    if tracking is not None and tracking.uri:
        tracking = tracking.model_copy(update={"uri": storage.resolve(tracking.uri)})
    reward = spec.reward
    if reward.model is not None:
        served = reward.model.model_copy(update={"path": storage.resolve(reward.model.path)})
        reward = reward.model_copy(update={"model": served})
    update = {
        "model": model,
        "dataset": dataset,
        "checkpoint": checkpoint,
        "tracking": tracking,
        "reward": reward,
    }
    return spec.model_copy(update=update)
