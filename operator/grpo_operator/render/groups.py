"""Rollout servers that span nodes: one LeaderWorkerSet group per server (rollout.nodesPerServer > 1).

Called by `render.children` in place of the rollout StatefulSet. Pure. The LeaderWorkerSet
controller (kubernetes-sigs/lws, `leaderworkerset.x-k8s.io/v1`) makes a leader StatefulSet named
like ours (`<job>-rollout`, so leader pods keep the names, DNS and endpoints a one-node server has) and
one worker StatefulSet per group (`<job>-rollout-<server>`), and restarts a group whole when any of its
pods is lost (`RecreateGroupOnPodRestart`): a vLLM engine spanning nodes cannot take a member back.

- Leader pod: our server (`python -m grpo_rollout serve`), with the first
  vllm.dataParallelSize / nodesPerServer engines, hosting vLLM's data-parallel coordinator at its own pod
  IP (`ENV_DP_ADDRESS`) on `api.contract.VLLM_DP_RPC_PORT`.
- Worker pods: `python -m grpo_rollout headless`, vLLM's headless mode with the next engines, joining
  the leader at `LWS_LEADER_ADDRESS`; no API port, no token, no readiness probe of their own (the
  leader is ready only once every engine answers).
- Both find their server index in the LWS group-index label and keep a group under as few network
  spines as the fleet allows (preferred pod affinity keyed on the group, as the trainer gang's is).
"""

import copy

from grpo_operator.api.contract import ENV_DP_ADDRESS, ENV_POD_INDEX, ENV_TOKEN
from grpo_operator.render import names
from grpo_operator.render.pods import NETWORK_LAYER_KEYS, ZONE_KEY

KIND = "LeaderWorkerSet"
HEADLESS_COMMAND = ["python", "-m", "grpo_rollout", "headless"]


def leader_template(template: dict, job: str) -> dict:
    """The rollout pod template as a group's leader: the server, told its own address for vLLM."""
    out = _grouped(template, job)
    container = _container(out)
    container["env"].append(
        {"name": ENV_DP_ADDRESS, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    )
    return out


def worker_template(template: dict, job: str) -> dict:
    """The rollout pod template as a group's worker: vLLM's headless engines, no API of its own."""
    out = _grouped(template, job)
    container = _container(out)
    container["command"] = list(HEADLESS_COMMAND)
    container["env"] = [e for e in container["env"] if e["name"] != ENV_TOKEN]  # it serves nothing
    for key in ("ports", "readinessProbe"):
        container.pop(key, None)
    return out


def leaderworkerset(name: str, replicas: int, nodes: int, leader: dict, worker: dict, meta) -> dict:
    """`replicas` servers of `nodes` pods each. LeaderCreated: workers start with their leader, which
    waits for them (LeaderReady would never start them: the leader is ready only with its workers)."""
    return {
        "apiVersion": names.LWS_API_VERSION,
        "kind": KIND,
        "metadata": meta(names.statefulset(name, names.ROLE_ROLLOUT)),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},  # pods under our `<job>-rollout` Service
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def service_selector(name: str) -> dict[str, str]:
    """The rollout Service selects leaders only: they serve the API; workers resolve the leader's DNS
    name (not-ready addresses published: the leader is not ready before its workers join)."""
    return {**names.selector(name, names.ROLE_ROLLOUT), names.LABEL_LWS_WORKER_INDEX: "0"}


def network_policies(name: str, uid: str, servers: int, meta) -> list[dict]:
    """One NetworkPolicy per server: its pods reach each other on any port (vLLM's data-parallel RPC
    and coordinator ports, torch.distributed, NCCL), and no other server's pods. Policies of servers
    scaled away stay until the job goes: they select no pod, and serve again on a scale-up."""
    out = []
    for group in range(servers):
        pods = {"matchLabels": {**names.isolation_selector(name, uid, names.ROLE_ROLLOUT),
                                names.LABEL_LWS_GROUP_INDEX: str(group)}}  # fmt: skip
        out.append(
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": meta(names.group_network_policy(name, group)),
                "spec": {
                    "podSelector": pods,
                    "policyTypes": ["Ingress"],
                    "ingress": [{"from": [{"podSelector": pods}]}],
                },
            }
        )
    return out


def _grouped(template: dict, job: str) -> dict:
    """A copy whose pods read their server index from the LWS group and stay near their group."""
    out = copy.deepcopy(template)
    container = _container(out)
    group = {"fieldRef": {"fieldPath": f"metadata.labels['{names.LABEL_LWS_GROUP_INDEX}']"}}
    container["env"] = [
        {"name": ENV_POD_INDEX, "valueFrom": group} if e["name"] == ENV_POD_INDEX else e
        for e in container["env"]
    ]
    spec = out["spec"]
    affinity = dict(spec.get("affinity") or {})
    affinity["podAffinity"] = _group_affinity(job)
    spec["affinity"] = affinity
    return out


def _group_affinity(job: str) -> dict:
    """A group's pods in one zone (required) and under as few network spines as possible (preferred),
    keyed on the group by matchLabelKeys (the group key LWS gives each group's pods)."""

    def term(key: str) -> dict:
        return {
            "labelSelector": {"matchLabels": names.selector(job, names.ROLE_ROLLOUT)},
            "matchLabelKeys": [names.LABEL_LWS_GROUP_KEY],
            "topologyKey": key,
        }

    return {
        "requiredDuringSchedulingIgnoredDuringExecution": [term(ZONE_KEY)],
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": weight, "podAffinityTerm": term(key)}
            for weight, key in zip((100, 50, 10), NETWORK_LAYER_KEYS, strict=True)
        ],
    }


def _container(template: dict) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == names.ROLE_ROLLOUT)
