"""Every child object of a GRPOJob, rendered as plain dicts ready for server-side apply.

Called by the controller on each reconcile and by `grpo-operator render`; the local runtime
reads the StatefulSets' pod templates (commands, env) from the same output. Pure: the same
inputs give the same manifests, which is what lets the controller skip unchanged children.
"""

from dataclasses import dataclass, field

from grpo_operator.api.contract import CONTRACT_FILE, RunContract
from grpo_operator.api.job import GROUP, PLURAL, GRPOJob
from grpo_operator.instance_types import InstanceTable
from grpo_operator.instance_types import load as load_instance_types
from grpo_operator.render import groups, kueue, names, pods
from grpo_operator.render.contract import RenderError
from grpo_operator.render.contract import contract as render_contract

MAX_CONTRACT_BYTES = 1 << 20  # a ConfigMap's data, as the API server limits it

POD_GROUP_API = {
    "scheduler-plugins": "scheduling.x-k8s.io/v1alpha1",
    "volcano": "scheduling.volcano.sh/v1beta1",
}


@dataclass
class Rendered:
    """The children, the contract they carry, and template conflicts to report."""

    children: list[dict]
    contract: RunContract
    warnings: list[str] = field(default_factory=list)


def render(
    job: GRPOJob,
    *,
    name: str,
    namespace: str,
    uid: str,
    generation: int = 1,
    attempt: int = 0,
    running: bool = True,
    zone: str | None = None,
    avoid_nodes: tuple[str, ...] = (),
    instance_types: InstanceTable | None = None,
    flavors: dict[str, kueue.FlavorPlacement] | None = None,
    rollout_replicas: int | None = None,
    metrics_from: list[dict] | None = None,
) -> Rendered:
    """Render all children. `attempt` labels the trainer gang (bumped per gang restart);
    `running=False` (suspended or finished) scales every role to zero pods; `zone`
    pins the trainer gang to one availability zone chosen by the caller and `avoid_nodes` keeps it
    off nodes the caller saw lost (see pods).
    `flavors` (per role) add the node labels and tolerations of the Kueue ResourceFlavors a
    queued job was admitted on; `rollout_replicas` caps rollout pods at what Kueue admitted.
    `metrics_from` (NetworkPolicy peers, e.g. the Prometheus pods' namespace and pod selectors)
    may reach the pods' metrics ports; by default no one outside the job may."""
    table = instance_types or load_instance_types()
    run = render_contract(
        job,
        name=name,
        namespace=namespace,
        generation=generation,
        uid=uid,
        instance_types=table,
        rollout_replicas=rollout_replicas,
    )
    trainer_tpl, w1 = pods.pod_template(
        job,
        name=name,
        uid=uid,
        role=names.ROLE_TRAINER,
        attempt=attempt,
        table=table,
        zone=zone,
        avoid_nodes=avoid_nodes,
    )
    rollout_tpl, w2 = pods.pod_template(
        job, name=name, uid=uid, role=names.ROLE_ROLLOUT, attempt=attempt, table=table
    )
    templates = {names.ROLE_TRAINER: trainer_tpl, names.ROLE_ROLLOUT: rollout_tpl}
    if job.spec.reward.model is not None:
        templates[names.ROLE_REWARD], w3 = pods.pod_template(
            job, name=name, uid=uid, role=names.ROLE_REWARD, attempt=attempt, table=table
        )
        w2 += w3
    for role, placement in (flavors or {}).items():
        if role in templates:
            templates[role], conflicts = kueue.with_flavor(templates[role], placement)
            w1 += [f"{role}: {c}" for c in conflicts]
    trainer_tpl, rollout_tpl = templates[names.ROLE_TRAINER], templates[names.ROLE_ROLLOUT]
    trainer_n = job.spec.trainer.replicas if running else 0
    rollout_n = job.spec.rollout.replicas if rollout_replicas is None else rollout_replicas
    rollout_n = rollout_n if running else 0
    spans = job.spec.rollout.spans_nodes

    def meta(obj_name: str) -> dict:
        return {
            "name": obj_name,
            "namespace": namespace,
            "labels": names.job_labels(name),
            "ownerReferences": [names.owner_reference(name, uid)],
        }

    out = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta(names.contract_configmap(name)),
            "data": {CONTRACT_FILE: run.model_dump_json(by_alias=True, exclude_none=True, indent=2)},
        },
        *_rbac(job, name, meta),
        *_network_policies(
            name,
            uid,
            meta,
            metrics_from or [],
            streams=job.spec.rollout.streams_weights,
            reward=job.spec.reward.model is not None,
        ),  # before any pod exists
        *(groups.network_policies(name, uid, rollout_n, meta) if spans else []),
        _service(name, names.ROLE_TRAINER, names.TRAINER_PORT, "rendezvous", meta, publish_not_ready=True),
        _rollout_service(name, meta, spans=spans),
        _rollout_servers(job, name, rollout_n, rollout_tpl, meta),
        _statefulset(name, names.ROLE_TRAINER, trainer_n, trainer_tpl, meta, on_delete=True),
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta(names.statefulset(name, names.ROLE_TRAINER)),
            "spec": {
                "minAvailable": job.spec.trainer.replicas,
                "selector": {"matchLabels": names.selector(name, names.ROLE_TRAINER)},
            },
        },
    ]
    if names.ROLE_REWARD in templates:
        out += _reward_servers(job, name, templates[names.ROLE_REWARD], meta, running=running)
    group = _pod_group(job, name, meta)
    if group:
        out.append(group)
    return Rendered(children=out, contract=run, warnings=w1 + w2)


def validate(job: GRPOJob, *, name: str, namespace: str, instance_types: InstanceTable) -> None:
    """Raise RenderError for a job no pass could render (its name, topology, or hardware), so the
    controller can fail it before deciding anything, and render only jobs that will render."""
    run = render_contract(job, name=name, namespace=namespace, instance_types=instance_types)
    size = len(run.model_dump_json(by_alias=True, exclude_none=True, indent=2).encode())
    if size > MAX_CONTRACT_BYTES:
        raise RenderError(
            f"the run contract (the spec, resolved) is {size} bytes, over the {MAX_CONTRACT_BYTES} a "
            "ConfigMap holds: move large values (env, reward columns) into files the pods read"
        )
    for role in (names.ROLE_TRAINER, names.ROLE_ROLLOUT):
        pods.hardware(job, role, instance_types)
    if job.spec.reward.model is not None:
        pods.hardware(job, names.ROLE_REWARD, instance_types)


def children(job: GRPOJob, *, name: str, namespace: str, uid: str, **kwargs) -> list[dict]:
    """The children only (see `render` for the keyword arguments)."""
    return render(job, name=name, namespace=namespace, uid=uid, **kwargs).children


def token_secret(*, name: str, namespace: str, uid: str, token: str) -> dict:
    """The per-job Secret whose `token` guards the rollout API (created once, never rendered
    on reconcile, because its value is random)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": names.token_secret(name, uid),
            "namespace": namespace,
            "labels": names.job_labels(name),
            "ownerReferences": [names.owner_reference(name, uid)],
        },
        "type": "Opaque",
        "stringData": {names.TOKEN_KEY: token},
    }


def _rbac(job: GRPOJob, name: str, meta) -> list[dict]:
    """A ServiceAccount per role (IRSA annotations per role; the reward role's with spec.reward.model)
    and a Role for the trainer only, limited by resourceNames to this job's status and contract, plus
    listing EndpointSlices."""
    accounts = []
    roles = [(names.ROLE_TRAINER, job.spec.trainer), (names.ROLE_ROLLOUT, job.spec.rollout)]
    if job.spec.reward.model is not None:
        roles.append((names.ROLE_REWARD, job.spec.reward.model))
    for role, spec in roles:
        sa = {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": meta(names.service_account(name, role)),
        }
        if spec.service_account_annotations:
            sa["metadata"]["annotations"] = dict(spec.service_account_annotations)
        accounts.append(sa)
    rules = [
        {"apiGroups": [GROUP], "resources": [PLURAL], "resourceNames": [name], "verbs": ["get"]},
        {
            "apiGroups": [GROUP],
            "resources": [f"{PLURAL}/status"],
            "resourceNames": [name],
            "verbs": ["get", "patch"],
        },
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [names.contract_configmap(name)],
            "verbs": ["get"],
        },
        # Rank 0 follows the rollout servers live (grpo_trainer/membership.py). EndpointSlice names
        # are generated, so no resourceNames: the namespace's slices, read only.
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]},
    ]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(names.role(name))}
    role["rules"] = rules
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta(names.role(name)),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": names.role(name)},
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": names.service_account(name, names.ROLE_TRAINER),
                "namespace": meta(name)["namespace"],
            }
        ],
    }
    return [*accounts, role, binding]


def _service(name: str, role: str, port: int, port_name: str, meta, *, publish_not_ready: bool) -> dict:
    """Headless Service: per-pod DNS for rendezvous (before readiness) or rollout discovery."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(names.statefulset(name, role)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": publish_not_ready,
            "selector": names.selector(name, role),
            "ports": [{"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def _rollout_service(name: str, meta, *, spans: bool) -> dict:
    """The rollout servers' Service: ready pods only, or for servers spanning nodes their leaders, not
    ready ones included (workers resolve the leader before it is ready; the trainer reads `serving`)."""
    service = _service(name, names.ROLE_ROLLOUT, names.ROLLOUT_PORT, "http", meta, publish_not_ready=spans)
    if spans:
        service["spec"]["selector"] = groups.service_selector(name)
    return service


def _rollout_servers(job: GRPOJob, name: str, replicas: int, template: dict, meta) -> dict:
    """A StatefulSet of one-pod servers, or a LeaderWorkerSet of servers spanning nodes."""
    nodes = job.spec.rollout.nodes_per_server
    if nodes == 1:
        return _statefulset(name, names.ROLE_ROLLOUT, replicas, template, meta, on_delete=False)
    leader, worker = groups.leader_template(template, name), groups.worker_template(template, name)
    return groups.leaderworkerset(name, replicas, nodes, leader, worker, meta)


def _reward_servers(job: GRPOJob, name: str, template: dict, meta, *, running: bool) -> list[dict]:
    """spec.reward.model's servers: a StatefulSet of one-pod servers (replaced one by one, like the
    rollout's), their headless Service (ready pods only: the rollout servers send batches to those),
    and a PodDisruptionBudget that lets a drain take one server at a time."""
    model = job.spec.reward.model
    replicas = model.replicas if running and model is not None else 0
    return [
        _service(name, names.ROLE_REWARD, names.REWARD_PORT, "http", meta, publish_not_ready=False),
        _statefulset(name, names.ROLE_REWARD, replicas, template, meta, on_delete=False),
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta(names.statefulset(name, names.ROLE_REWARD)),
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": names.selector(name, names.ROLE_REWARD)},
            },
        },
    ]


def _statefulset(name: str, role: str, replicas: int, template: dict, meta, *, on_delete: bool) -> dict:
    """Parallel pod management; the trainer uses OnDelete so only the operator's gang
    restart replaces its pods, never a rolling update one rank at a time."""
    strategy = {"type": "OnDelete"} if on_delete else {"type": "RollingUpdate"}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(names.statefulset(name, role)),
        "spec": {
            "replicas": replicas,
            "serviceName": names.statefulset(name, role),
            "podManagementPolicy": "Parallel",
            "updateStrategy": strategy,
            "selector": {"matchLabels": names.selector(name, role)},
            "template": template,
        },
    }


def _network_policies(
    name: str, uid: str, meta, metrics_from: list[dict], *, streams: bool, reward: bool
) -> list[dict]:
    """Ingress of each role's pods, selected with the job's uid label that only the operator
    sets. Trainer pods: any port (c10d rendezvous on TRAINER_PORT, gloo/NCCL on ephemeral
    ports), only from this job's trainer pods, and `metrics_from` to rank 0's /metrics on
    TRAINER_METRICS_PORT alone. Rollout pods: the API port, from this job's trainer pods and, for
    /metrics on the same port, `metrics_from`. Egress stays open: S3, the rollout servers, the
    API server. With the collective weight transport (`streams`) the two roles also reach each
    other on any port: rollout servers join rank 0's store on WEIGHT_SYNC_PORT, and gloo/NCCL
    connect both ways on ephemeral ports. Reward model servers (`reward`): REWARD_PORT only, from
    this job's rollout pods (the only callers of /score) and, for /metrics, `metrics_from`."""

    def pods(role: str) -> dict:
        return {"matchLabels": names.isolation_selector(name, uid, role)}

    rollout_port = [{"protocol": "TCP", "port": names.ROLLOUT_PORT}]
    trainer_ingress = [{"from": [{"podSelector": pods(names.ROLE_TRAINER)}]}]
    rollout_ingress = [{"from": [{"podSelector": pods(names.ROLE_TRAINER)}], "ports": rollout_port}]
    if metrics_from:
        trainer_metrics_port = [{"protocol": "TCP", "port": names.TRAINER_METRICS_PORT}]
        trainer_ingress.append({"from": metrics_from, "ports": trainer_metrics_port})
        rollout_ingress.append({"from": metrics_from, "ports": rollout_port})
    if streams:
        trainer_ingress.append({"from": [{"podSelector": pods(names.ROLE_ROLLOUT)}]})
        rollout_ingress.append({"from": [{"podSelector": pods(names.ROLE_TRAINER)}]})
    ingress = {names.ROLE_TRAINER: trainer_ingress, names.ROLE_ROLLOUT: rollout_ingress}
    if reward:
        reward_port = [{"protocol": "TCP", "port": names.REWARD_PORT}]
        ingress[names.ROLE_REWARD] = [
            {"from": [{"podSelector": pods(names.ROLE_ROLLOUT)}], "ports": reward_port}
        ]
        if metrics_from:
            ingress[names.ROLE_REWARD].append({"from": metrics_from, "ports": reward_port})
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(names.network_policy(name, role)),
            "spec": {"podSelector": pods(role), "policyTypes": ["Ingress"], "ingress": ingress[role]},
        }
        for role in ingress
    ]


def _pod_group(job: GRPOJob, name: str, meta) -> dict | None:
    kind = job.spec.scheduling.pod_group
    if kind not in POD_GROUP_API:
        return None
    spec: dict = {"minMember": job.spec.trainer.replicas}
    if kind == "volcano" and job.spec.scheduling.queue:
        spec["queue"] = job.spec.scheduling.queue
    return {
        "apiVersion": POD_GROUP_API[kind],
        "kind": "PodGroup",
        "metadata": meta(names.pod_group(name)),
        "spec": spec,
    }
