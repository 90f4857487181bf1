"""One table of GRPOJob specs, escalating and benign, for the escalation rules' two implementations.

tests/unit/test_escalation.py runs it through `validation.escalation.refusals` and through the
chart's ValidatingAdmissionPolicy CEL (cel-python); tests/e2e/test_admission_policy.py sends it
to a real API server under an impersonated user. Each case is a patch deep-merged onto BASE.
"""

import copy
from dataclasses import dataclass, field
from typing import Any

BASE: dict[str, Any] = {
    "apiVersion": "grpo.dev/v1alpha1",
    "kind": "GRPOJob",
    "metadata": {"name": "esc"},
    "spec": {
        "model": {"path": "/models/tiny"},
        "dataset": {"path": "/data/prompts.jsonl"},
        "reward": {"functions": [{"builtin": "exact_match"}]},
        "trainer": {"processesPerPod": 1},
    },
}


@dataclass(frozen=True)
class Case:
    id: str
    patch: dict[str, Any]
    # Field paths the refusals must start with, in order; empty for a benign job.
    fields: tuple[str, ...] = field(default=())


def _pod(role: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {role: {"template": {"spec": spec}}}}


def _sidecar(**extra: Any) -> dict[str, Any]:
    return {"name": "side", "image": "busybox:1.36", **extra}


T = "spec.trainer.template.spec"
R = "spec.rollout.template.spec"
ESCALATIONS = [
    Case("network-privileged", {"spec": {"network": {"privileged": True}}}, ("spec.network.privileged",)),
    Case("host-network", _pod("trainer", {"hostNetwork": True}), (f"{T}.hostNetwork",)),
    Case("host-pid", _pod("rollout", {"hostPID": True}), (f"{R}.hostPID",)),
    Case("host-ipc", _pod("trainer", {"hostIPC": True}), (f"{T}.hostIPC",)),
    Case(
        "host-port",
        _pod("rollout", {"containers": [_sidecar(ports=[{"containerPort": 80, "hostPort": 80}])]}),
        (f"{R}.containers[side].ports",),
    ),
    Case(
        "host-path",
        _pod("trainer", {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}),
        (f"{T}.volumes[root].hostPath",),
    ),
    Case(
        "privileged-sidecar",
        _pod("trainer", {"containers": [_sidecar(securityContext={"privileged": True})]}),
        (f"{T}.containers[side].securityContext.privileged",),
    ),
    Case(
        "privileged-init",
        _pod("rollout", {"initContainers": [_sidecar(securityContext={"privileged": True})]}),
        (f"{R}.initContainers[side].securityContext.privileged",),
    ),
    Case(
        "added-capability",
        _pod(
            "trainer",
            {
                "containers": [
                    {"name": "trainer", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}
                ]
            },
        ),
        (f"{T}.containers[trainer].securityContext.capabilities.add",),
    ),
    Case(
        "unconfined-seccomp",
        _pod("trainer", {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}),
        (f"{T}.securityContext",),
    ),
    Case(
        "unmasked-proc",
        _pod("rollout", {"containers": [_sidecar(securityContext={"procMount": "Unmasked"})]}),
        (f"{R}.containers[side].securityContext",),
    ),
    Case(
        "apparmor-annotation",
        {
            "spec": {
                "trainer": {
                    "template": {
                        "metadata": {
                            "annotations": {
                                "container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"
                            }
                        }
                    }
                }
            }
        },
        ("spec.trainer.template.metadata.annotations",),
    ),
    Case(
        "secret-volume",
        _pod("trainer", {"volumes": [{"name": "creds", "secret": {"secretName": "db"}}]}),
        (f"{T}.volumes[creds].secret",),
    ),
    Case(
        "projected-token",
        _pod(
            "rollout",
            {
                "volumes": [
                    {"name": "tok", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
                ]
            },
        ),
        (f"{R}.volumes[tok].projected",),
    ),
    Case(
        "env-from-secret",
        _pod("trainer", {"containers": [{"name": "trainer", "envFrom": [{"secretRef": {"name": "db"}}]}]}),
        (f"{T}.containers[trainer].envFrom.secretRef",),
    ),
    Case(
        "env-secret-key",
        _pod(
            "rollout",
            {
                "containers": [
                    _sidecar(
                        env=[
                            {"name": "PLAIN", "value": "1"},
                            {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db", "key": "pw"}}},
                        ]
                    )
                ]
            },
        ),
        (f"{R}.containers[side].env[PASSWORD].valueFrom.secretKeyRef",),
    ),
    Case("service-account", _pod("trainer", {"serviceAccountName": "admin"}), (f"{T}.serviceAccountName",)),
    Case("node-name", _pod("rollout", {"nodeName": "node-1"}), (f"{R}.nodeName",)),
    Case(
        "priority-class",
        _pod("trainer", {"priorityClassName": "system-cluster-critical"}),
        (f"{T}.priorityClassName",),
    ),
    Case(
        "pvc",
        _pod(
            "trainer", {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "other-team"}}]}
        ),
        (f"{T}.volumes[data].persistentVolumeClaim",),
    ),
    Case(
        "nfs",
        _pod("rollout", {"volumes": [{"name": "share", "nfs": {"server": "10.0.0.1", "path": "/"}}]}),
        (f"{R}.volumes[share].nfs",),
    ),
    Case(
        "reward-model-host-path",
        {
            "spec": {
                "reward": {
                    "model": {
                        "path": "/models/rm",
                        "template": {
                            "metadata": {
                                "annotations": {
                                    "container.apparmor.security.beta.kubernetes.io/side": "unconfined"
                                }
                            },
                            "spec": {
                                "hostNetwork": True,
                                "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
                            },
                        },
                    }
                }
            }
        },
        (
            "spec.reward.model.template.spec.hostNetwork",
            "spec.reward.model.template.spec.volumes[h].hostPath",
            "spec.reward.model.template.metadata.annotations",
        ),
    ),
]
# Several at once, in both roles: every one is named, in the policy's order.
MANY = Case(
    "many",
    {
        "spec": {
            "network": {"privileged": True},
            "trainer": {
                "template": {
                    "spec": {
                        "hostPID": True,
                        "nodeName": "node-1",
                        "volumes": [
                            {"name": "ok", "emptyDir": {}},
                            {"name": "h", "hostPath": {"path": "/var"}},
                        ],
                        "initContainers": [
                            _sidecar(
                                securityContext={"privileged": True, "capabilities": {"add": ["NET_ADMIN"]}}
                            )
                        ],
                    }
                }
            },
            "rollout": {
                "template": {
                    "spec": {
                        "serviceAccount": "x",
                        "containers": [_sidecar(envFrom=[{"secretRef": {"name": "s"}}])],
                    }
                }
            },
        }
    },
    (
        "spec.network.privileged",
        f"{T}.hostPID",
        f"{T}.nodeName",
        f"{T}.volumes[h].hostPath",
        f"{T}.initContainers[side].securityContext.privileged",
        f"{T}.initContainers[side].securityContext.capabilities.add",
        f"{R}.serviceAccount",
        f"{R}.containers[side].envFrom.secretRef",
    ),
)
# Secrets the requester may `get` (the e2e test grants exactly these with a Role; the unit test's
# stand-in authorizer allows exactly these). A credentialsSecret outside it is an escalation.
READABLE_SECRETS = ("team-s3", "team-tracking", "team-judge-keys")
CREDENTIALS_SECRET = Case(
    "credentials-secret",
    {"spec": {"storage": {"endpointUrl": "http://minio.storage:9000", "credentialsSecret": "other-team-s3"}}},
    ("spec.storage.credentialsSecret",),
)
ESCALATIONS.append(CREDENTIALS_SECRET)
TRACKING_SECRET = Case(  # a readable storage Secret beside a foreign tracking one: only the latter refused
    "tracking-secret",
    {
        "spec": {
            "storage": {"endpointUrl": "http://minio.storage:9000", "credentialsSecret": "team-s3"},
            "tracking": {
                "backend": "mlflow",
                "uri": "http://mlflow.tracking:5000",
                "credentialsSecret": "other-team-mlflow",
            },
        }
    },
    ("spec.tracking.credentialsSecret",),
)
ESCALATIONS.append(TRACKING_SECRET)
REWARD_SECRET = Case(  # a hosted judge's key: mounted as files in the rollout pods
    "reward-secret",
    {"spec": {"reward": {"functions": [{"builtin": "math"}], "credentialsSecret": "other-team-openai"}}},
    ("spec.reward.credentialsSecret",),
)
ESCALATIONS.append(REWARD_SECRET)
BENIGN = Case(
    "benign",
    {
        "spec": {
            "model": {"path": "pvc://models/tiny"},
            "scheduling": {"priorityClassName": "gpu-training"},
            "storage": {"endpointUrl": "http://minio.storage:9000", "credentialsSecret": "team-s3"},
            "tracking": {"backend": "wandb", "credentialsSecret": "team-tracking"},
            "reward": {"functions": [{"builtin": "math"}], "credentialsSecret": "team-judge-keys"},
            "trainer": {
                "serviceAccountAnnotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r"},
                "template": {
                    "metadata": {"annotations": {"example.com/team": "rl"}},
                    "spec": {
                        "imagePullSecrets": [{"name": "registry"}],
                        "securityContext": {
                            "seccompProfile": {"type": "RuntimeDefault"},
                            "runAsNonRoot": True,
                        },
                        "volumes": [
                            {"name": "scratch", "emptyDir": {}},
                            {"name": "cfg", "configMap": {"name": "cfg"}},
                            {
                                "name": "info",
                                "downwardAPI": {
                                    "items": [{"path": "l", "fieldRef": {"fieldPath": "metadata.labels"}}]
                                },
                            },
                            {"name": "bundle", "projected": {"sources": [{"configMap": {"name": "cfg"}}]}},
                        ],
                        "containers": [
                            {
                                "name": "trainer",
                                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                "envFrom": [{"configMapRef": {"name": "cfg"}}],
                                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                            },
                            _sidecar(
                                securityContext={
                                    "capabilities": {"drop": ["ALL"]},
                                    "allowPrivilegeEscalation": False,
                                },
                                ports=[{"containerPort": 9000}],
                            ),
                        ],
                    },
                },
            },
        }
    },
)


def merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base.get(k), v)
        return out
    return copy.deepcopy(patch)


def job(case: Case, name: str | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    out = merge(BASE, case.patch)
    out["metadata"] = {"name": name or f"esc-{case.id}"}
    if annotations:
        out["metadata"]["annotations"] = dict(annotations)
    return out
