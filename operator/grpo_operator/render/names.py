"""Names, labels and ports of a GRPOJob's children: the one place that spells them.

Used by the renderer, the controller (to find children and pods) and tests. StatefulSet pod
names and Service DNS names derive from these, so they are part of the run contract.
"""

from grpo_operator.api.job import API_VERSION, KIND

LABEL_JOB = "grpo.dev/job"
LABEL_ROLE = "grpo.dev/role"
LABEL_ATTEMPT = "grpo.dev/attempt"
# The job's uid on every pod the operator renders; NetworkPolicies select on it together with
# the job and role labels, and a user's template may not set it (render.overrides).
LABEL_JOB_UID = "grpo.dev/job-uid"
# the all2all backend a rollout pod's vLLM runs (rollout.vllm.all2allBackend resolved), for kubectl describe
ANNOTATION_ALL2ALL = "grpo.dev/vllm-all2all-backend"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# What the LeaderWorkerSet controller puts on a multi-node server's pods (leaderworkerset_types.go of
# sigs.k8s.io/lws v0.8.0): its group (= server index) and its place in the group (0: the leader).
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LABEL_LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LABEL_LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LABEL_LWS_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MANAGER = "grpo-operator"

ROLE_TRAINER = "trainer"
ROLE_ROLLOUT = "rollout"
ROLE_REWARD = "reward"  # spec.reward.model's servers

TRAINER_PORT = 29500
TRAINER_METRICS_PORT = 9400  # rank 0's Prometheus /metrics (the container port `metrics`)
WEIGHT_SYNC_PORT = 29600  # rank 0's weight-sync TCPStore, which rollout servers join (collective transport)
ROLLOUT_PORT = 8000
REWARD_PORT = 8100
TOKEN_KEY = "token"
PVC_MOUNT_ROOT = "/mnt/pvc"
CACHE_VOLUME = "model-cache"  # the emptyDir at spec.storage.cacheDir, on both roles

# A StatefulSet's pods carry `controller-revision-hash: <sts>-<10 chars>` (63 max), so the
# StatefulSet name may have 52 characters; "-trainer" leaves 44 for the job name.
MAX_JOB_NAME = 44
# A multi-node server's worker StatefulSet is `<job>-rollout-<server>` (LeaderWorkerSet), servers up
# to 4095: 52 - len("-rollout-4095") leaves 39.
MAX_GROUPED_JOB_NAME = 39


def workload(job: str) -> str:
    """The Kueue Workload of a queued job (Kueue's own integrations name theirs `<kind>-<name>-...`)."""
    return f"grpojob-{job}"


def statefulset(job: str, role: str) -> str:
    """Name of the role's StatefulSet, also its headless Service and its pods' prefix."""
    return f"{job}-{role}"


def pod(job: str, role: str, index: int) -> str:
    return f"{statefulset(job, role)}-{index}"


def group_network_policy(job: str, group: int) -> str:
    """The NetworkPolicy that lets the pods of one multi-node rollout server reach each other."""
    return f"{statefulset(job, ROLE_ROLLOUT)}-group-{group}"


def contract_configmap(job: str) -> str:
    return f"{job}-contract"


def token_secret(job: str, uid: str) -> str:
    """The job's rollout-token Secret, named per uid: a job deleted and recreated under the same
    name never finds its predecessor's Secret (which garbage collection is about to delete)."""
    return f"{job}-token-{uid[:8]}"


def network_policy(job: str, role: str) -> str:
    return statefulset(job, role)


def service_account(job: str, role: str) -> str:
    return f"{job}-{role}"


def role(job: str) -> str:
    """Name of the Role (and RoleBinding) that lets the trainer report status."""
    return f"{job}-trainer"


def pod_group(job: str) -> str:
    return f"{job}-trainer"


def job_labels(job: str) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGER, LABEL_JOB: job}


def selector(job: str, role: str) -> dict[str, str]:
    """Labels that select one role's pods of one job (StatefulSet selector; immutable)."""
    return {LABEL_JOB: job, LABEL_ROLE: role}


def isolation_selector(job: str, uid: str, role: str) -> dict[str, str]:
    """Labels that select one role's pods of this incarnation of the job in NetworkPolicies:
    the pod selector plus the uid, which only the operator sets. Not for the StatefulSet
    selector, which is immutable: existing StatefulSets could not be updated."""
    return {**selector(job, role), LABEL_JOB_UID: uid}


def label_selector(job: str, role: str | None = None) -> str:
    """The same as a label selector string for list calls."""
    sel = {LABEL_JOB: job} if role is None else selector(job, role)
    return ",".join(f"{k}={v}" for k, v in sel.items())


def server_selector(job: str, *, spans: bool = False) -> str:
    """A pod per rollout server, as a label selector (the scale subresource's, for an HPA or KEDA):
    the rollout pods, or of servers spanning nodes their leaders."""
    leaders = f",{LABEL_LWS_WORKER_INDEX}=0" if spans else ""
    return label_selector(job, ROLE_ROLLOUT) + leaders


def owner_reference(job: str, uid: str) -> dict[str, object]:
    """Owner reference to the GRPOJob: deleting the job garbage-collects the child."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def service_dns(job: str, role: str, namespace: str) -> str:
    return f"{statefulset(job, role)}.{namespace}.svc"


def pod_dns(job: str, role: str, index: int, namespace: str) -> str:
    """Stable DNS name of one StatefulSet pod behind its headless Service."""
    return f"{pod(job, role, index)}.{service_dns(job, role, namespace)}"
