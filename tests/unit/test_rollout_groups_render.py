"""Rollout servers that span nodes (rollout.nodesPerServer > 1) render as one LeaderWorkerSet group per
server: the leader serves, workers run vLLM's headless engines, and nothing else of the job changes."""

import pytest
from grpo_operator import render
from grpo_operator.api.contract import ENV_DP_ADDRESS, ENV_POD_INDEX, ENV_TOKEN
from grpo_operator.render import names

from tests.support.render import SEED_SERVER, by_kind, env, job, rendered

WIDE = SEED_SERVER | {"replicas": 3}
GROUP_INDEX = {"fieldRef": {"fieldPath": f"metadata.labels['{names.LABEL_LWS_GROUP_INDEX}']"}}


def wide(**fields) -> render.Rendered:
    return rendered(job(rollout=WIDE | fields))


def lws(r: render.Rendered) -> dict:
    return by_kind(r, "LeaderWorkerSet", "moe-rollout")


def main_container(template: dict) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == "rollout")


def test_a_server_spanning_nodes_is_a_leaderworkerset_group_and_replicas_count_servers() -> None:
    r = wide()
    assert not [
        c for c in r.children if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "moe-rollout"
    ]
    spec = lws(r)["spec"]
    assert spec["replicas"] == 3  # servers, not pods
    assert spec["leaderWorkerTemplate"]["size"] == 4
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once its workers joined
    assert lws(r)["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # leader pods are named as one-node servers are: the contract's endpoints do not change
    assert r.contract.rollout.endpoints[2] == "http://moe-rollout-2.moe-rollout.team.svc:8000"
    assert by_kind(wide(), "StatefulSet", "moe-trainer")  # the trainer is what it was
    scaled = lws(rendered(job(rollout=WIDE), rollout_replicas=5))
    assert scaled["spec"]["replicas"] == 5
    assert lws(rendered(job(rollout=WIDE), running=False))["spec"]["replicas"] == 0


def test_every_pod_takes_a_whole_node_and_reads_its_server_index_from_the_group() -> None:
    template = lws(wide())["spec"]["leaderWorkerTemplate"]
    for member in ("leaderTemplate", "workerTemplate"):
        pod = template[member]
        c = main_container(pod)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8", member
        assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "16", member
        assert env(c)[ENV_POD_INDEX] == GROUP_INDEX, member
        assert env(c)["NCCL_GIN_TYPE"] == "2", (
            member
        )  # DeepEP v2's GIN settings, from the trainer's one place
        assert pod["metadata"]["annotations"][names.ANNOTATION_ALL2ALL] == "deepep_v2", member
        assert pod["metadata"]["labels"][names.LABEL_JOB_UID] == "uid-1", member
        affinity = pod["spec"]["affinity"]["podAffinity"]
        required = affinity["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert required["matchLabelKeys"] == [names.LABEL_LWS_GROUP_KEY], member
        assert required["topologyKey"] == "topology.kubernetes.io/zone"


def test_the_leader_serves_and_workers_run_vllms_headless_engines() -> None:
    template = lws(wide())["spec"]["leaderWorkerTemplate"]
    leader, worker = main_container(template["leaderTemplate"]), main_container(template["workerTemplate"])
    assert leader["command"] == ["python", "-m", "grpo_rollout", "serve"]
    assert env(leader)[ENV_DP_ADDRESS] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert ENV_TOKEN in env(leader) and leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert worker["command"] == ["python", "-m", "grpo_rollout", "headless"]
    assert ENV_TOKEN not in env(worker)  # a worker serves no API: it never holds the job's token
    assert "readinessProbe" not in worker and "ports" not in worker


def test_the_service_publishes_leaders_before_they_are_ready_and_one_policy_joins_each_group() -> None:
    r = wide()
    service = by_kind(r, "Service", "moe-rollout")["spec"]
    assert service["publishNotReadyAddresses"] is True  # workers resolve their leader before it is ready
    assert service["selector"][names.LABEL_LWS_WORKER_INDEX] == "0"  # the trainer reaches leaders only
    policies = {c["metadata"]["name"]: c["spec"] for c in r.children if c["kind"] == "NetworkPolicy"}
    groups = [policies[names.group_network_policy("moe", g)] for g in range(3)]
    for g, policy in enumerate(groups):
        selector = policy["podSelector"]["matchLabels"]
        assert selector[names.LABEL_LWS_GROUP_INDEX] == str(g)
        assert selector[names.LABEL_JOB_UID] == "uid-1"
        assert policy["ingress"] == [{"from": [{"podSelector": policy["podSelector"]}]}]  # its own group only
    assert names.group_network_policy("moe", 3) not in policies
    plain = rendered()
    assert by_kind(plain, "Service", "moe-rollout")["spec"]["publishNotReadyAddresses"] is False
    assert by_kind(plain, "StatefulSet", "moe-rollout")
    assert not [c for c in plain.children if c["kind"] == "LeaderWorkerSet"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"vllm": {"dataParallelSize": 16, "expertParallelSize": 16}},
            r"rollout.tensorParallelSize x vllm.dataParallelSize = 16 GPUs per server, but "
            r"rollout.nodesPerServer 4 x 8 GPUs of p5en.48xlarge = 32",
        ),
        (
            {"nodesPerServer": 1},
            r"= 32 exceeds the 8 GPUs of p5en.48xlarge: set rollout.nodesPerServer 4",
        ),
    ],
)
def test_a_layout_that_does_not_fill_its_nodes_is_refused_naming_the_numbers(
    fields: dict, message: str
) -> None:
    with pytest.raises(render.RenderError, match=message):
        wide(**fields)


def test_a_job_name_too_long_for_the_groups_statefulsets_is_refused() -> None:
    j = job(rollout=WIDE)
    with pytest.raises(render.RenderError, match="at most 39 fit"):
        render.render(j, name="a" * 40, namespace="team", uid="u")
    render.render(job(), name="a" * 40, namespace="team", uid="u")  # one-node servers: 44 fit
