"""What a GRPOJob asks for beyond what GRPOJob `create` grants: one refusal per escalation.

A pure function of the job and its annotations. The chart's ValidatingAdmissionPolicy
(charts/grpo-operator/templates/admission-policy.yaml) refuses the same escalations at admission
unless the requester holds the `escalate` verb on grpojobs; tests/unit/test_escalation.py runs
one table of specs through both and requires the same messages in the same order. Callers: the
controller (second line: a job that bypassed admission is Failed, never rendered) and
`grpo-operator validate` (warnings). docs/security.md explains each rule.

Every field that reaches a pod is covered: `spec.network.privileged`, and the pod template overrides
`spec.{trainer,rollout}.template` and `spec.reward.model.template`, whose `spec` is merged onto the
rendered pod field by field. The typed fields (`pvc://` URIs, `scheduling.priorityClassName`,
tolerations, node selectors, `serviceAccountAnnotations`, `storage.endpointUrl`) are the job's own
and allowed; the operator's own IPC_LOCK for EFA is not in the spec at all.

Two typed fields depend on who asks: `spec.storage.credentialsSecret` and
`spec.tracking.credentialsSecret` name Secrets the pods read, each allowed when the requester may
`get` that Secret (the policy asks the API server's authorizer) or holds `escalate`. This module
cannot know the requester: `refusals` checks it only when given `may_get_secret` (the unit tests
pass a stand-in authorizer); the operator's second line and `grpo-operator validate` pass none,
so for these fields the admission policy is the only guard (docs/security.md).
"""

from collections.abc import Callable, Mapping
from typing import Any

from grpo_operator.api.job import ESCALATE_VERB, ESCALATION_APPROVED_ANNOTATION, GROUP, GRPOJob
from grpo_operator.api.roles import PodTemplateOverride

PERMISSION = f"the {GROUP} '{ESCALATE_VERB}' permission"
ROLES = ("trainer", "rollout")
HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")
# Pod fields that pick another identity, node or priority than the operator's.
NAMED_FIELDS = (
    ("nodeName", "binding pods to a node needs"),
    ("priorityClassName", "a pod priority class needs"),
    ("serviceAccountName", "another ServiceAccount needs"),
    ("serviceAccount", "another ServiceAccount needs"),
)
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
# Every core/v1 volume source except emptyDir, configMap, downwardAPI, projected and image: host
# paths, Secrets, claims, and sources the kubelet mounts with node credentials or a node's network.
FORBIDDEN_VOLUMES = (
    "hostPath",
    "secret",
    "persistentVolumeClaim",
    "ephemeral",
    "csi",
    "nfs",
    "iscsi",
    "fc",
    "rbd",
    "cephfs",
    "glusterfs",
    "flexVolume",
    "flocker",
    "gitRepo",
    "awsElasticBlockStore",
    "gcePersistentDisk",
    "azureDisk",
    "azureFile",
    "cinder",
    "vsphereVolume",
    "photonPersistentDisk",
    "portworxVolume",
    "quobyte",
    "scaleIO",
    "storageos",
)
# The admission policy's refusal of the annotation itself (the operator has no requester to check).
APPROVAL_REFUSAL = (
    f"metadata.annotations[{ESCALATION_APPROVED_ANNOTATION}]: "
    f"only requesters with {PERMISSION} may set or keep it"
)
APPARMOR_ANNOTATION_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
UNCONFINED = "Unconfined"


def secret_reads(job: GRPOJob) -> list[tuple[str, str]]:
    """(field path, Secret name) of every Secret a typed field makes the pods read."""
    tracking = job.spec.tracking
    reads = [
        ("spec.storage.credentialsSecret", job.spec.storage.credentials_secret),
        ("spec.tracking.credentialsSecret", tracking.credentials_secret if tracking else None),
        ("spec.reward.credentialsSecret", job.spec.reward.credentials_secret),
    ]
    return [(field, secret) for field, secret in reads if secret]


def secret_refusal(field: str, secret: str) -> str:
    return f"{field}: reading Secret '{secret}' needs get on it or {PERMISSION}"


def refusals(
    job: GRPOJob, annotations: Mapping[str, str], *, may_get_secret: Callable[[str], bool] | None = None
) -> list[str]:
    """One message per escalation in `job`, each starting with its field path; [] when there is none
    or the job carries ESCALATION_APPROVED_ANNOTATION: "true". Secret reads of typed fields
    (`secret_reads`) are refused only when `may_get_secret` is given and says no."""
    if annotations.get(ESCALATION_APPROVED_ANNOTATION) == "true":
        return []
    out = []
    if job.spec.network.privileged:
        out.append(f"spec.network.privileged: privileged containers need {PERMISSION}")
    templates = [(f"spec.{role}.template", getattr(job.spec, role).template) for role in ROLES]
    reward = job.spec.reward.model
    templates.append(("spec.reward.model.template", reward.template if reward is not None else None))
    for path, template in templates:
        if template is not None:
            out += _template_refusals(path, template)
    if may_get_secret is not None:
        out += [secret_refusal(f, name) for f, name in secret_reads(job) if not may_get_secret(name)]
    return out


def _template_refusals(path: str, template: PodTemplateOverride) -> list[str]:
    spec = template.spec or {}
    out = _pod_refusals(f"{path}.spec", spec)
    annotations = template.metadata.annotations if template.metadata else {}
    if any(k.startswith(APPARMOR_ANNOTATION_PREFIX) and v == "unconfined" for k, v in annotations.items()):
        out.append(f"{path}.metadata.annotations: unconfined AppArmor profiles need {PERMISSION}")
    return out


def _pod_refusals(path: str, spec: dict[str, Any]) -> list[str]:
    out = [f"{path}.{f}: host namespaces need {PERMISSION}" for f in HOST_NAMESPACES if spec.get(f) is True]
    out += [f"{path}.{f}: {what} {PERMISSION}" for f, what in NAMED_FIELDS if f in spec and spec[f] != ""]
    if _relaxed(_dict(spec.get("securityContext")), pod=True):
        out.append(f"{path}.securityContext: {_RELAXED} need {PERMISSION}")
    volumes = _dicts(spec.get("volumes"))
    for volume in volumes:
        kinds = [k for k in FORBIDDEN_VOLUMES if k in volume]
        if kinds:
            out.append(
                f"{path}.volumes[{volume.get('name')}].{kinds[0]}: {kinds[0]} volumes need {PERMISSION}"
            )
    for volume in volumes:
        sources = _dicts(_dict(volume.get("projected")).get("sources"))
        if any("secret" in s or "serviceAccountToken" in s for s in sources):
            out.append(
                f"{path}.volumes[{volume.get('name')}].projected: Secret and ServiceAccount token sources "
                f"need {PERMISSION}"
            )
    for field in CONTAINER_LISTS:
        out += _container_refusals(f"{path}.{field}", _dicts(spec.get(field)))
    return out


_RELAXED = "unconfined or host-level security settings"


def _container_refusals(path: str, containers: list[dict[str, Any]]) -> list[str]:
    """Per rule, then per container: the order the policy's CEL builds its list in."""
    out = []
    for c in containers:
        if _dict(c.get("securityContext")).get("privileged") is True:
            out.append(
                f"{path}[{c.get('name')}].securityContext.privileged: privileged containers need {PERMISSION}"
            )
    for c in containers:
        if _dict(_dict(c.get("securityContext")).get("capabilities")).get("add"):
            added = f"{path}[{c.get('name')}].securityContext.capabilities.add"
            out.append(f"{added}: added capabilities need {PERMISSION}")
    for c in containers:
        if _relaxed(_dict(c.get("securityContext")), pod=False):
            out.append(f"{path}[{c.get('name')}].securityContext: {_RELAXED} need {PERMISSION}")
    for c in containers:
        if any(p.get("hostPort", 0) != 0 for p in _dicts(c.get("ports"))):
            out.append(f"{path}[{c.get('name')}].ports: host ports need {PERMISSION}")
    for c in containers:
        secret_env = [e for e in _dicts(c.get("env")) if "secretKeyRef" in _dict(e.get("valueFrom"))]
        if secret_env:
            out.append(
                f"{path}[{c.get('name')}].env[{secret_env[0].get('name')}].valueFrom.secretKeyRef: "
                f"Secret references need {PERMISSION}"
            )
    for c in containers:
        if any("secretRef" in e for e in _dicts(c.get("envFrom"))):
            out.append(f"{path}[{c.get('name')}].envFrom.secretRef: Secret references need {PERMISSION}")
    return out


def _relaxed(security: dict[str, Any], *, pod: bool) -> bool:
    """Settings Pod Security `baseline` forbids, beyond privilege and capabilities (checked alone)."""
    if "seLinuxOptions" in security:
        return True
    if pod and security.get("sysctls"):
        return True
    if not pod and security.get("procMount") == "Unmasked":
        return True
    profiles = (_dict(security.get(k)).get("type") for k in ("seccompProfile", "appArmorProfile"))
    if UNCONFINED in profiles:
        return True
    return _dict(security.get("windowsOptions")).get("hostProcess") is True


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []
