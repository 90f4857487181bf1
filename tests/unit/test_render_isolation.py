"""Unit tests of the isolation the renderer builds in: NetworkPolicies of both roles selected on the
job's uid label, that label on every pod and out of a template's reach, and the per-uid token
Secret (docs/security.md, "Network isolation" and "Ownership of child objects")."""

import pytest
from grpo_operator import render
from grpo_operator.render import names, overrides

from tests.support.render import by_kind, container, env, job, rendered

PROMETHEUS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}


def http_job():
    """Weights over HTTP: the narrowest policies (streamed weights also open trainer <-> rollout on
    any port, see test_weight_sync_config)."""
    return job(rollout__weightSync={"transport": "http"})


def pods_of(role: str, uid: str = "uid-1") -> dict:
    return {"matchLabels": {"grpo.dev/job": "moe", "grpo.dev/role": role, "grpo.dev/job-uid": uid}}


def test_trainer_pods_take_ingress_only_from_the_same_jobs_trainer_pods_on_any_port():
    policy = by_kind(rendered(http_job()), "NetworkPolicy", "moe-trainer")
    assert policy["spec"] == {
        "podSelector": pods_of("trainer"),
        "policyTypes": ["Ingress"],  # egress stays open: S3, rollout servers, the API server
        # No `ports`: c10d rendezvous on 29500 and gloo/NCCL on ephemeral ports.
        "ingress": [{"from": [{"podSelector": pods_of("trainer")}]}],
    }


def test_rollout_api_port_only_from_the_same_jobs_trainer_pods_by_default():
    policy = by_kind(rendered(http_job()), "NetworkPolicy", "moe-rollout")
    assert policy["spec"] == {
        "podSelector": pods_of("rollout"),
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [{"podSelector": pods_of("trainer")}],
                "ports": [{"protocol": "TCP", "port": names.ROLLOUT_PORT}],
            }
        ],
    }


def test_metrics_scrapers_reach_the_rollout_port_and_only_the_trainers_metrics_port():
    r = rendered(http_job(), metrics_from=[PROMETHEUS])
    rollout = by_kind(r, "NetworkPolicy", "moe-rollout")["spec"]["ingress"]
    assert rollout[1] == {"from": [PROMETHEUS], "ports": [{"protocol": "TCP", "port": names.ROLLOUT_PORT}]}
    trainer = by_kind(r, "NetworkPolicy", "moe-trainer")["spec"]["ingress"]
    assert trainer[0] == by_kind(rendered(http_job()), "NetworkPolicy", "moe-trainer")["spec"]["ingress"][0]
    metrics_port = {"protocol": "TCP", "port": names.TRAINER_METRICS_PORT}
    assert trainer[1:] == [{"from": [PROMETHEUS], "ports": [metrics_port]}]  # never rendezvous or NCCL
    (port,) = [p for p in container(r, "trainer")["ports"] if p["name"] == "metrics"]
    assert port["containerPort"] == names.TRAINER_METRICS_PORT


def test_policies_exist_before_any_pod_and_follow_the_uid():
    kinds = [c["kind"] for c in rendered().children]
    assert kinds.index("NetworkPolicy") < kinds.index("StatefulSet")
    other = render.render(job(), name="moe", namespace="team", uid="uid-2")
    selected = by_kind(other, "NetworkPolicy", "moe-trainer")["spec"]["podSelector"]
    assert selected == pods_of("trainer", "uid-2")


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_pods_carry_the_uid_label_but_the_immutable_selector_does_not(role):
    sts = by_kind(rendered(), "StatefulSet", f"moe-{role}")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert labels[names.LABEL_JOB_UID] == "uid-1"
    assert sts["spec"]["selector"] == {"matchLabels": {"grpo.dev/job": "moe", "grpo.dev/role": role}}
    policy = by_kind(rendered(), "NetworkPolicy", f"moe-{role}")["spec"]["podSelector"]["matchLabels"]
    assert policy.items() <= labels.items(), "the policy selects the job's own pods"


@pytest.mark.parametrize("label", [names.LABEL_JOB_UID, names.LABEL_JOB, names.LABEL_ROLE])
def test_a_template_cannot_set_the_labels_policies_trust(label):
    r = rendered(job(rollout__template={"metadata": {"labels": {label: "forged", "team": "rl"}}}))
    labels = by_kind(r, "StatefulSet", "moe-rollout")["spec"]["template"]["metadata"]["labels"]
    assert labels[label] != "forged" and labels["team"] == "rl"
    (warning,) = r.warnings
    assert warning.startswith(f"rollout.template.metadata.labels.{label}: only the operator sets")
    assert "'forged'" in warning


def test_a_template_repeating_the_operators_label_value_is_no_conflict():
    r = rendered(job(trainer__template={"metadata": {"labels": {names.LABEL_JOB_UID: "uid-1"}}}))
    assert r.warnings == []


def test_token_secret_is_named_per_uid_and_pods_read_that_one():
    secret = render.token_secret(name="moe", namespace="team", uid="0f3c9a2e-1111-2222", token="t")
    assert secret["metadata"]["name"] == "moe-token-0f3c9a2e"
    assert secret["metadata"]["ownerReferences"] == [names.owner_reference("moe", "0f3c9a2e-1111-2222")]
    r = render.render(job(), name="moe", namespace="team", uid="0f3c9a2e-1111-2222")
    for role in ("trainer", "rollout"):
        ref = env(container(r, role))["GRPO_TOKEN"]["secretKeyRef"]
        assert ref == {"name": "moe-token-0f3c9a2e", "key": names.TOKEN_KEY}


def test_longest_job_name_keeps_a_valid_token_secret_name():
    name = "x" * names.MAX_JOB_NAME
    assert len(names.token_secret(name, "0f3c9a2e-1111")) <= 63


def test_only_the_pods_own_labels_are_protected():
    claim = {"metadata": {"labels": {names.LABEL_JOB: "x"}}}
    user = {"spec": {"volumes": [{"name": "scratch", "ephemeral": {"volumeClaimTemplate": claim}}]}}
    merged, conflicts = overrides.merge({"metadata": {"labels": {}}, "spec": {}}, user, "trainer.template")
    assert conflicts == [] and merged["spec"]["volumes"][0]["ephemeral"]["volumeClaimTemplate"] == claim
