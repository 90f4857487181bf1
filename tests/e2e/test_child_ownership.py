"""E2E: a job never takes over what it does not own, and its pods are fenced by NetworkPolicies.

The operator runs as a process against the local control plane (the fixtures of
tests/support/operator_e2e.py, as in test_operator.py). Covers the security issue's "a
pre-existing object with a child's name is left untouched and the job says why", "trainer pods
are selected by a NetworkPolicy", and the per-uid token Secret that a delete-and-recreate of a
job never finds stale.
"""

from grpo_operator.api.job import GROUP, PLURAL, VERSION
from kubernetes import client

from tests.support import operator_e2e as base

# The operator tests' fixtures, shared by name (pytest finds them as module attributes).
crd, operator, cluster = base.crd, base.operator, base.cluster
CONFLICT = "ChildConflict"


def warnings(cluster: base.Cluster, name: str, reason: str) -> list[client.CoreV1Event]:
    events = cluster.core.list_namespaced_event(
        cluster.ns, field_selector=f"involvedObject.name={name},involvedObject.kind=GRPOJob"
    ).items
    return [e for e in events if e.type == "Warning" and e.reason == reason]


def said_why(cluster: base.Cluster, name: str) -> str | None:
    """The message of the job's ChildConflict condition or, failing that, Warning Event."""
    for c in cluster.status(name).get("conditions") or []:
        if c.get("reason") == CONFLICT and c.get("status") == "True":
            return c["message"]
    found = warnings(cluster, name, CONFLICT)
    return found[0].message if found else None


def token_ref(pod: client.V1Pod) -> str:
    (ref,) = [e.value_from.secret_key_ref.name for e in pod.spec.containers[0].env if e.name == "GRPO_TOKEN"]
    return ref


def test_a_foreign_object_with_a_childs_name_is_left_untouched_and_the_job_says_why(
    operator, cluster, wait_for
):
    account = {
        "metadata": {
            "name": "etl-trainer",
            "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/etl"},
        }
    }
    before = cluster.core.create_namespaced_service_account(cluster.ns, account)
    cluster.create(base.manifest("etl"))
    message = wait_for(lambda: said_why(cluster, "etl"), what="the job names the conflict", timeout=60)
    assert "ServiceAccount etl-trainer exists and is not owned by this GRPOJob (owner: none)" in message
    after = cluster.core.read_namespaced_service_account("etl-trainer", cluster.ns)
    assert after.metadata.resource_version == before.metadata.resource_version
    assert (
        not after.metadata.owner_references
        and after.metadata.annotations == account["metadata"]["annotations"]
    )
    # The gang was not started half-made: nothing was applied, not even the children before it.
    assert cluster.children() == []
    assert cluster.status("etl").get("phase") not in ("Running", "Starting")

    # Deleting the foreign object lets the job go on, with a ServiceAccount of its own.
    cluster.core.delete_namespaced_service_account("etl-trainer", cluster.ns)
    cluster.wait_phase("etl", "Running")
    uid = cluster.job("etl")["metadata"]["uid"]
    owned = cluster.core.read_namespaced_service_account("etl-trainer", cluster.ns)
    assert [(r.uid, r.controller) for r in owned.metadata.owner_references] == [(uid, True)]


def test_a_recreated_job_gets_a_new_token_secret_and_its_pods_use_it(operator, cluster, wait_for):
    cluster.create(base.manifest("again"))
    cluster.wait_phase("again", "Running")
    first = cluster.job("again")["metadata"]["uid"]
    assert {token_ref(p) for p in cluster.pods("again", "trainer")} == {f"again-token-{first[:8]}"}
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, cluster.ns, PLURAL, "again")
    wait_for(lambda: cluster.gone("again"), what="the first job deleted", timeout=60)

    cluster.create(base.manifest("again"))
    second = cluster.job("again")["metadata"]["uid"]
    assert second[:8] != first[:8]
    cluster.wait_phase("again", "Running", timeout=180)  # after the first one's children are collected
    secret = cluster.core.read_namespaced_secret(f"again-token-{second[:8]}", cluster.ns)
    assert [r.uid for r in secret.metadata.owner_references] == [second]
    pods = cluster.pods("again", "trainer") + cluster.pods("again", "rollout")
    assert pods and {token_ref(p) for p in pods} == {f"again-token-{second[:8]}"}
    assert {p.metadata.labels["grpo.dev/job-uid"] for p in pods} == {second}


def test_trainer_pods_are_selected_by_a_policy_that_admits_only_their_own_gang(operator, cluster):
    cluster.create(base.manifest("fenced"))
    cluster.wait_phase("fenced", "Running")
    uid = cluster.job("fenced")["metadata"]["uid"]
    net = client.NetworkingV1Api(cluster.core.api_client)
    policies = net.list_namespaced_network_policy(cluster.ns).items
    trainers = cluster.pods("fenced", "trainer")
    assert len(trainers) == 2

    def selects(policy: client.V1NetworkPolicy, labels: dict[str, str]) -> bool:
        wanted = policy.spec.pod_selector.match_labels or {}
        return not policy.spec.pod_selector.match_expressions and wanted.items() <= labels.items()

    for pod in trainers:
        (policy,) = [p for p in policies if selects(p, pod.metadata.labels)]
        assert policy.metadata.name == "fenced-trainer" and policy.spec.policy_types == ["Ingress"]
        gang = {"grpo.dev/job": "fenced", "grpo.dev/role": "trainer", "grpo.dev/job-uid": uid}
        assert policy.spec.pod_selector.match_labels == gang
        # the gang (rendezvous, gloo/NCCL) and, as weights stream, the job's rollout servers
        servers = {**gang, "grpo.dev/role": "rollout"}
        assert len(policy.spec.ingress) == 2
        for rule, peers in zip(policy.spec.ingress, (gang, servers), strict=True):
            assert rule.ports is None, "rendezvous and gloo/NCCL ports: all of them, to these pods only"
            (peer,) = rule._from
            assert peer.namespace_selector is None and peer.ip_block is None, "this namespace only"
            assert peer.pod_selector.match_labels == peers and not peer.pod_selector.match_expressions
    rollout = net.read_namespaced_network_policy("fenced-rollout", cluster.ns)
    assert rollout.spec.pod_selector.match_labels["grpo.dev/job-uid"] == uid
    assert [peer.pod_selector.match_labels["grpo.dev/role"] for peer in rollout.spec.ingress[0]._from] == [
        "trainer"
    ]
