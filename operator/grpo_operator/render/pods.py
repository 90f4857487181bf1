"""EFA-aware pod templates for the trainer gang, the rollout servers and the reward model servers.

Called by `render.children`. Sizes each pod from the instance-type table (`instance_types`):
GPUs and EFA devices of the node, hugepages, IPC_LOCK, /dev/shm, EFA/NCCL env (GIN for DeepEP v2),
the model cache emptyDir and S3 env (spec.storage),
node selector, GPU tolerations and, for the gang, one-zone and network-spine affinity.
The user's template override is merged last; the operator's fields win (see overrides).
"""

from dataclasses import dataclass

from grpo_operator.api.contract import CONTRACT_FILE, CONTRACT_MOUNT, ENV_CONTRACT, ENV_POD_INDEX, ENV_TOKEN
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.roles import EPBackend, RoleCommon, VllmAll2AllBackend, resolve_all2all
from grpo_operator.api.spec import ENV_REWARD_FILES, REWARD_FILES_MOUNT, EFAMode
from grpo_operator.api.storage import SECRET_KEYS
from grpo_operator.api.tracking import OPTIONAL_SECRET_KEYS
from grpo_operator.api.tracking import SECRET_KEYS as TRACKING_SECRET_KEYS
from grpo_operator.instance_types import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    INSTANCE_TYPE_LABEL,
    InstanceTable,
    InstanceType,
    UnknownInstanceType,
)
from grpo_operator.render import names, overrides, storage
from grpo_operator.render.contract import RenderError

COMMANDS = {
    names.ROLE_TRAINER: ["python", "-m", "grpo_trainer", "train"],
    names.ROLE_ROLLOUT: ["python", "-m", "grpo_rollout", "serve"],
    names.ROLE_REWARD: ["python", "-m", "grpo_rollout", "reward"],
}
ZONE_KEY = "topology.kubernetes.io/zone"
NETWORK_LAYER_KEYS = tuple(f"topology.k8s.aws/network-node-layer-{n}" for n in (3, 2, 1))
GRACE_SECONDS = {names.ROLE_TRAINER: 60, names.ROLE_ROLLOUT: 120, names.ROLE_REWARD: 60}
# The container port named `http` of each serving role (its readiness probe and Service port).
REWARD_FILES_VOLUME = "reward-credentials"
HTTP_PORTS = {names.ROLE_ROLLOUT: names.ROLLOUT_PORT, names.ROLE_REWARD: names.REWARD_PORT}


def role_spec(job: GRPOJob, role: str) -> RoleCommon:
    """The spec of one role: spec.trainer, spec.rollout, or spec.reward.model (set: the caller renders
    the reward role only for a job that has one)."""
    if role == names.ROLE_TRAINER:
        return job.spec.trainer
    if role == names.ROLE_REWARD:
        if job.spec.reward.model is None:
            raise ValueError("the reward role is rendered only with spec.reward.model")
        return job.spec.reward.model
    return job.spec.rollout


@dataclass(frozen=True)
class Hardware:
    """What one pod of a role asks of its node."""

    instance_type: InstanceType | None
    gpus: int
    efa: int


def hardware(job: GRPOJob, role: str, table: InstanceTable) -> Hardware:
    """GPUs and EFA devices per pod of `role`; RenderError when the spec cannot be met."""
    spec = role_spec(job, role)
    mode = job.spec.network.efa
    itype = None
    if spec.instance_type is not None:
        try:
            itype = table.get(spec.instance_type)
        except UnknownInstanceType as e:
            field = "reward.model" if role == names.ROLE_REWARD else role
            raise RenderError(f"{field}.instanceType: {e}") from None
    node_gpus, node_efa = (itype.gpus, itype.efa) if itype else (0, 0)
    if role == names.ROLE_TRAINER:
        if mode == EFAMode.REQUIRED and node_efa == 0:
            what = (
                f"instance type {itype.name!r} has no EFA devices"
                if itype
                else "trainer.instanceType is unset"
            )
            raise RenderError(f"network.efa is 'required' but {what}; use an EFA type (p4d, p5, p5en, p6...)")
        gpus, efa = node_gpus, node_efa
    elif role == names.ROLE_REWARD:
        # A reward model server answers HTTP on tensorParallelSize GPUs of one node: it needs no
        # inter-node fabric (no EFA, no hugepages), and the rest of the node stays free for other pods.
        tp = job.spec.reward.model.tensor_parallel_size if job.spec.reward.model else 1
        if itype and node_gpus and tp > node_gpus:
            raise RenderError(
                f"reward.model.tensorParallelSize {tp} exceeds the {node_gpus} GPU(s) of {itype.name}: "
                "a reward server runs inside one node"
            )
        return Hardware(itype, tp if node_gpus else 0, 0)
    else:
        rollout = job.spec.rollout
        per_server = rollout.gpus_per_server  # tensorParallelSize x vllm.dataParallelSize
        nodes = rollout.nodes_per_server
        if itype and nodes > 1 and per_server != nodes * node_gpus:
            raise RenderError(
                f"rollout.tensorParallelSize x vllm.dataParallelSize = {per_server} GPUs per server, but "
                f"rollout.nodesPerServer {nodes} x {node_gpus} GPUs of {itype.name} = {nodes * node_gpus}: "
                "a server spanning nodes takes them whole"
            )
        if itype and node_gpus and per_server > node_gpus and nodes == 1:
            raise RenderError(
                f"rollout.tensorParallelSize x vllm.dataParallelSize = {per_server} exceeds the "
                f"{node_gpus} GPUs of {itype.name}: set rollout.nodesPerServer "
                f"{-(-per_server // node_gpus)} for a server spanning nodes"
            )
        gpus = min(rollout.gpus_per_node, node_gpus)
        efa = node_efa if node_gpus and gpus == node_gpus else 0
    return Hardware(itype, gpus, 0 if mode == EFAMode.DISABLED else efa)


def pod_template(
    job: GRPOJob,
    *,
    name: str,
    uid: str,
    role: str,
    attempt: int,
    table: InstanceTable,
    zone: str | None = None,
    avoid_nodes: tuple[str, ...] = (),
) -> tuple[dict, list[str]]:
    """(pod template, override conflicts) for one role's StatefulSet; `uid` is the job's, on
    the pods' labels (what NetworkPolicies select on) and in the token Secret's name.

    `zone` (trainer only) becomes a node selector. The gang's required one-zone affinity
    alone lets rank 0 pick a zone too small for the rest (a deadlock the e2e fleet shows:
    one p5 in us-west-2b), so the controller chooses a zone with room for the whole gang.
    `avoid_nodes` (trainer only): nodes the controller saw lost; a new attempt is never bound
    there, even by a scheduler whose cache still lists a node just deleted.
    """
    spec = role_spec(job, role)
    hw = hardware(job, role, table)
    volumes, mounts = _volumes(job, name=name, role=role)
    container = {
        "name": role,
        "image": spec.image,
        "command": COMMANDS[role],
        "env": _env(job, name=name, uid=uid, hw=hw, role=role),
        "ports": _ports(role),
        "resources": _resources(job, spec, hw),
        "volumeMounts": mounts,
        # why the container ended, for status: the stated message ("<Reason>: ..."), else the log's tail
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    security = _security(job, hw)
    if security:
        container["securityContext"] = security
    if role in HTTP_PORTS:
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5}
    labels = {**names.job_labels(name), **names.isolation_selector(name, uid, role)}
    annotations: dict[str, str] = {}
    if role == names.ROLE_ROLLOUT and (all2all := resolve_all2all(job.spec.rollout)):
        annotations[names.ANNOTATION_ALL2ALL] = all2all  # what the pod's vLLM is told, from the same function
    pod_spec: dict = {
        "serviceAccountName": names.service_account(name, role),
        "automountServiceAccountToken": role == names.ROLE_TRAINER,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": GRACE_SECONDS[role],
        "containers": [container],
        "volumes": volumes,
    }
    if role == names.ROLE_TRAINER:
        container["env"] += _tracking_env(job)
        labels[names.LABEL_ATTEMPT] = str(attempt)
        pod_spec["affinity"] = _gang_affinity(name) if hw.instance_type else None
        if avoid_nodes:
            pod_spec["affinity"] = {**(pod_spec["affinity"] or {}), **_away_from(avoid_nodes)}
        _gang_scheduling(job, name, labels, annotations, pod_spec)
    _placement(spec, hw, pod_spec, zone if role == names.ROLE_TRAINER else None)
    sched = job.spec.scheduling
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    if sched.scheduler_name:
        pod_spec["schedulerName"] = sched.scheduler_name
    template = {"metadata": {"labels": labels}, "spec": {k: v for k, v in pod_spec.items() if v is not None}}
    if annotations:
        template["metadata"]["annotations"] = annotations
    if spec.template is None:
        return template, []
    user = {"spec": spec.template.spec or {}}
    if spec.template.metadata is not None:
        user["metadata"] = {k: v for k, v in spec.template.metadata.wire().items() if v}
    field_path = "reward.model.template" if role == names.ROLE_REWARD else f"{role}.template"
    return overrides.merge(template, user, field_path)


def _env(job: GRPOJob, *, name: str, uid: str, hw: Hardware, role: str) -> list[dict]:
    env = [
        {"name": ENV_CONTRACT, "value": f"{CONTRACT_MOUNT}/{CONTRACT_FILE}"},
        {
            "name": ENV_POD_INDEX,
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{names.LABEL_POD_INDEX}']"}},
        },
        {
            "name": ENV_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": names.token_secret(name, uid), "key": names.TOKEN_KEY}},
        },
    ]
    env += _storage_env(job)
    if role == names.ROLE_ROLLOUT and job.spec.reward.credentials_secret:
        env.append({"name": ENV_REWARD_FILES, "value": REWARD_FILES_MOUNT})
    if hw.efa or (hw.gpus and role != names.ROLE_REWARD):  # a reward server runs no collectives
        env.append({"name": "NCCL_SOCKET_IFNAME", "value": job.spec.network.socket_ifname})
    if hw.efa:
        env += [
            {"name": "FI_PROVIDER", "value": "efa"},
            {"name": "FI_EFA_FORK_SAFE", "value": "1"},
        ]
        if hw.instance_type and hw.instance_type.rdma:
            env.append({"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"})
        env += [{"name": k, "value": v} for k, v in GIN_ENV.items()]
        if uses_gin(job, role):
            env.append(GDRCOPY_ENV)
    return env


# NCCL GIN through aws-ofi-nccl needs GDRCopy (src/rdma/gin/nccl_ofi_gin_api.cpp at 1.21.1): the
# NVIDIA container toolkit puts the node's /dev/gdrdrv in a container that asks with this variable
# (the device plugin's GDRCOPY_ENABLED does the same in CDI mode); the images carry the library.
GDRCOPY_ENV = {"name": "NVIDIA_GDRCOPY", "value": "enabled"}


def uses_gin(job: GRPOJob, role: str) -> bool:
    """Pods that may run DeepEP v2 over NCCL GIN (pure): a rollout server whose all2all resolved to
    deepep_v2, a trainer whose EP group spans pods with epBackend deepep or auto (auto measures v2)."""
    spec = job.spec
    if role == names.ROLE_ROLLOUT:
        return resolve_all2all(spec.rollout) == str(VllmAll2AllBackend.DEEPEP_V2)
    if role == names.ROLE_TRAINER:
        t = spec.trainer
        return (
            t.ep_backend in (EPBackend.DEEPEP, EPBackend.AUTO)
            and t.expert_parallel_size > t.processes_per_pod
        )
    return False


# DeepEP across EFA nodes is v2 (`ElasticBuffer`) over NCCL GIN through aws-ofi-nccl (the
# trainer image's `ofi` net plugin, libnccl-net-ofi.so). GIN type 2 is the proxy path, which
# works on every EFA instance (plain p5 has nothing else); EFA-GDA (type 5, p5en/p6) needs the
# "unordered" kernels of AWS's DeepEP fork, so it is left to a template override. Nothing here
# names NVSHMEM or IBGDA/GDAKI: v1's internode path needs IBGDA, which EFA lacks, v1 inside a
# node needs no NVSHMEM, and v2 does not use NVSHMEM at run time.
GIN_ENV = {
    "NCCL_NET_PLUGIN": "ofi",
    "NCCL_GIN_PLUGIN": "ofi",
    "NCCL_GIN_TYPE": "2",
}


def _storage_env(job: GRPOJob) -> list[dict]:
    """AWS_* for an S3-compatible store (spec.storage); on AWS, Pod Identity / IRSA set them."""
    storage_spec = job.spec.storage
    env = []
    if storage_spec.endpoint_url:
        env.append({"name": "AWS_ENDPOINT_URL", "value": storage_spec.endpoint_url})
    if storage_spec.region:
        env.append({"name": "AWS_REGION", "value": storage_spec.region})
    if storage_spec.credentials_secret:
        env += [
            {
                "name": key,
                "valueFrom": {"secretKeyRef": {"name": storage_spec.credentials_secret, "key": key}},
            }
            for key in SECRET_KEYS
        ]
    return env


def _tracking_env(job: GRPOJob) -> list[dict]:
    """The tracking backend's credentials (spec.tracking.credentialsSecret) for rank 0's tracker."""
    tracking = job.spec.tracking
    if tracking is None or not tracking.credentials_secret:
        return []
    return [
        {
            "name": key,
            "valueFrom": {
                "secretKeyRef": {
                    "name": tracking.credentials_secret,
                    "key": key,
                    **({"optional": True} if key in OPTIONAL_SECRET_KEYS else {}),
                }
            },
        }
        for key in TRACKING_SECRET_KEYS.get(tracking.backend, ())
    ]


def _ports(role: str) -> list[dict]:
    if role == names.ROLE_TRAINER:
        return [
            {"name": "rendezvous", "containerPort": names.TRAINER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": names.TRAINER_METRICS_PORT, "protocol": "TCP"},
            {"name": "weight-sync", "containerPort": names.WEIGHT_SYNC_PORT, "protocol": "TCP"},
        ]
    return [{"name": "http", "containerPort": HTTP_PORTS[role], "protocol": "TCP"}]


def _resources(job: GRPOJob, spec: RoleCommon, hw: Hardware) -> dict:
    """User requests/limits with the operator's device resources on top (limits == requests)."""
    user = spec.resources
    requests = {k: str(v) for k, v in (user.requests if user else {}).items()}
    limits = {k: str(v) for k, v in (user.limits if user else {}).items()}
    owned: dict[str, str] = {}
    if hw.gpus:
        owned[hw.instance_type.gpu_resource if hw.instance_type else GPU_RESOURCE] = str(hw.gpus)
    if hw.efa:
        owned[EFA_RESOURCE] = str(hw.efa)
        owned["hugepages-2Mi"] = job.spec.network.hugepages
        if "cpu" not in requests and "memory" not in requests:
            requests["cpu"] = "1"  # the API server refuses hugepages without a cpu or memory request
    requests.update(owned)
    limits.update(owned)
    out = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _security(job: GRPOJob, hw: Hardware) -> dict:
    security: dict = {}
    if hw.efa:
        security["capabilities"] = {"add": ["IPC_LOCK"]}
    if job.spec.network.privileged:
        security["privileged"] = True
    return security


def _volumes(job: GRPOJob, *, name: str, role: str) -> tuple[list[dict], list[dict]]:
    spec = job.spec
    uris = [spec.model.path]
    if role == names.ROLE_REWARD and spec.reward.model is not None:
        uris = [spec.reward.model.path]  # the reward model only: it never loads the policy
    if role == names.ROLE_TRAINER:
        uris += [
            spec.model.reference_path,
            spec.dataset.path,
            spec.dataset.eval.path if spec.dataset.eval else None,
            spec.checkpoint.path,
            spec.checkpoint.resume_from,
            spec.tracking.uri if spec.tracking else None,  # TensorBoard's event files
        ]
    pvc_volumes, pvc_mounts = storage.volumes_and_mounts(uris)
    cache = {"sizeLimit": spec.storage.cache_size_limit} if spec.storage.cache_size_limit else {}
    volumes = [
        {"name": "contract", "configMap": {"name": names.contract_configmap(name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": names.CACHE_VOLUME, "emptyDir": cache},  # node-local disk: s3:// models, once per pod
        *pvc_volumes,
    ]
    mounts = [
        {"name": "contract", "mountPath": CONTRACT_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": names.CACHE_VOLUME, "mountPath": spec.storage.cache_dir},
        *pvc_mounts,
    ]
    if role == names.ROLE_ROLLOUT and spec.reward.credentials_secret:
        # files, not env: rewards run in a sandbox that strips secret-looking variables
        volumes.append(
            {
                "name": REWARD_FILES_VOLUME,
                "secret": {"secretName": spec.reward.credentials_secret, "defaultMode": 0o440},
            }
        )
        mounts.append({"name": REWARD_FILES_VOLUME, "mountPath": REWARD_FILES_MOUNT, "readOnly": True})
    return volumes, mounts


def _placement(spec: RoleCommon, hw: Hardware, pod_spec: dict, zone: str | None) -> None:
    """Node selector (instance type, zone) and tolerations for the devices the pod asks for."""
    selector = dict(spec.node_selector)
    if hw.instance_type:
        selector[INSTANCE_TYPE_LABEL] = hw.instance_type.name
    if zone and ZONE_KEY not in selector:
        selector[ZONE_KEY] = zone
    tolerations = []
    if hw.gpus:
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    if hw.efa:
        tolerations.append({"key": EFA_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    tolerations += [t.wire() for t in spec.tolerations]
    if selector:
        pod_spec["nodeSelector"] = selector
    if tolerations:
        pod_spec["tolerations"] = tolerations


def _away_from(nodes: tuple[str, ...]) -> dict:
    """Required node affinity: none of `nodes`, by name (a lost node's labels may be gone). The
    API server takes one value per `metadata.name` field selector: one NotIn each, ANDed."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in nodes]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def _gang_affinity(name: str) -> dict:
    """All ranks in one AZ (required) and under as few network spines as possible (preferred)."""

    def gang() -> dict:
        return {"matchLabels": names.selector(name, names.ROLE_TRAINER)}

    return {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": gang(), "topologyKey": ZONE_KEY}
            ],
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": weight, "podAffinityTerm": {"labelSelector": gang(), "topologyKey": key}}
                for weight, key in zip((100, 50, 10), NETWORK_LAYER_KEYS, strict=True)
            ],
        }
    }


def _gang_scheduling(job: GRPOJob, name: str, labels: dict, annotations: dict, pod_spec: dict) -> None:
    """Tie trainer pods to their PodGroup (scheduler-plugins label or Volcano annotation)."""
    kind = job.spec.scheduling.pod_group
    if kind == "scheduler-plugins":
        labels["scheduling.x-k8s.io/pod-group"] = names.pod_group(name)
    elif kind == "volcano":
        annotations["scheduling.k8s.io/group-name"] = names.pod_group(name)
        pod_spec["schedulerName"] = "volcano"
