"""The chart's escalation policy on a real API server, under impersonated identities.

The chart's ValidatingAdmissionPolicy, binding and escalate ClusterRole (rendered by helm with
release-unique names, the binding limited to this module's namespace so engineers sharing the
cluster are not affected) are installed once for the module. Three users act through kubectl
impersonation (`--as`): alice may only create and get GRPOJobs; carol may also update and patch
them; bob may create them and is bound to the chart's escalate ClusterRole. Each escalation of
tests/support/escalation_cases.py is refused for alice with exactly the messages
`validation.escalation.refusals` gives (the same table the unit test runs through cel-python);
her benign job is accepted; bob and a cluster admin may ask for `network.privileged` with the
approval annotation; carol may relabel bob's approved job (as the operator patches metadata) but
not change its spec. Every user may `get` the Secret `team-s3` (and no other): a job naming it as
`storage.credentialsSecret` is accepted, one naming another Secret is refused unless the
requester holds `escalate` (the policy asks the API server's authorizer).
"""

import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator.api.job import ESCALATION_APPROVED_ANNOTATION, GRPOJob
from grpo_operator.validation import escalation

from tests.support import escalation_cases as cases

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "grpo-operator"
CRD = ROOT / "crds" / "grpojobs.grpo.dev.yaml"
SELECTOR = "grpo.dev/admission-e2e"
APPROVED = {ESCALATION_APPROVED_ANNOTATION: "true"}
Kubectl = Callable[..., subprocess.CompletedProcess[str]]  # the conftest fixture
# Only create/get (the brief of a GRPOJob user); carol's extra verbs test UPDATE.
USERS = {
    "alice": ["create", "get"],
    "carol": ["create", "get", "update", "patch"],
    "bob": ["create", "get"],
}


@pytest.fixture(scope="module")
def admission(
    bin_dir: Path, kubectl: Kubectl, established: Callable[..., None], wait_for: Callable[..., Any]
) -> Iterator[str]:
    """A namespace under the chart's policy, with the three users' RBAC; returns its name."""
    run = f"r{uuid.uuid4().hex[:6]}"  # a label value: all digits would read back as a YAML number
    namespace = f"e2e-admission-{run}"
    release = f"adm-{run}"
    rendered = subprocess.run(
        [
            str(bin_dir / "helm"),
            "template",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--show-only",
            "templates/admission-policy.yaml",
            "--set",
            f"admissionPolicy.namespaceSelector.matchLabels.{SELECTOR.replace('.', chr(92) + '.')}={run}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    policy_objects = [d for d in yaml.safe_load_all(rendered) if d]
    escalate_role = next(d["metadata"]["name"] for d in policy_objects if d["kind"] == "ClusterRole")
    ns = {"apiVersion": "v1", "kind": "Namespace"}
    ns["metadata"] = {"name": namespace, "labels": {"grpo.dev/e2e": "true", SELECTOR: run}}
    rbac: list[dict[str, Any]] = [ns]
    for user, verbs in USERS.items():
        rule = {"apiGroups": ["grpo.dev"], "resources": ["grpojobs"], "verbs": verbs}
        rbac.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": f"{user}-grpojobs", "namespace": namespace},
                "rules": [rule],
            }
        )
        rbac.append(_binding(namespace, user, "Role", f"{user}-grpojobs"))
    rbac.append(_binding(namespace, "bob", "ClusterRole", escalate_role, name="bob-escalate"))
    rbac.append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "read-readable-secrets", "namespace": namespace},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["secrets"],
                    "verbs": ["get"],
                    "resourceNames": list(cases.READABLE_SECRETS),
                }
            ],
        }
    )
    for user in USERS:
        rbac.append(_binding(namespace, user, "Role", "read-readable-secrets", name=f"{user}-read-secrets"))
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    established("grpojobs.grpo.dev")
    try:
        kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(rbac + policy_objects))
        # Policies reach the admission plugin through an informer: wait until one refuses.
        probe = cases.job(cases.ESCALATIONS[0], name="probe")
        wait_for(
            lambda: create(kubectl, namespace, probe, "alice", dry_run=True).returncode != 0,
            what="the escalation policy to refuse alice's privileged job",
            timeout=30,
        )
        yield namespace
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False)
        for d in policy_objects:
            kubectl(
                "delete", d["kind"], d["metadata"]["name"], "--ignore-not-found", "--wait=false", check=False
            )


def _binding(namespace: str, user: str, kind: str, role: str, name: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name or f"{user}-grpojobs", "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }


def create(
    kubectl: Kubectl, namespace: str, job: dict[str, Any], user: str | None, dry_run: bool = False
) -> subprocess.CompletedProcess[str]:
    args = ["create", "-n", namespace, "-f", "-"]
    if user:
        args += [f"--as={user}", "--as-group=system:authenticated"]
    if dry_run:
        args.append("--dry-run=server")
    return kubectl(*args, input=json.dumps(job), check=False)  # JSON: no YAML 1.1 `n` == false


def expected(job: dict[str, Any], approval: bool = False) -> str:
    refusals = escalation.refusals(
        GRPOJob.model_validate(job), {}, may_get_secret=lambda name: name in cases.READABLE_SECRETS
    )
    return "; ".join([escalation.APPROVAL_REFUSAL] * approval + refusals)


def test_the_api_server_serves_validating_admission_policy_v1(kubectl: Kubectl) -> None:
    resources = kubectl("api-resources", "--api-group=admissionregistration.k8s.io", "-o", "name").stdout
    assert "validatingadmissionpolicies.admissionregistration.k8s.io" in resources.split()
    group = yaml.safe_load(kubectl("get", "--raw", "/apis/admissionregistration.k8s.io/v1").stdout)
    assert {"validatingadmissionpolicies", "validatingadmissionpolicybindings"} <= {
        r["name"] for r in group["resources"]
    }


ALL = [*cases.ESCALATIONS, cases.MANY]


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_grpojob_creator_is_refused_each_escalation_naming_the_field(
    admission: str, kubectl: Kubectl, case: cases.Case
) -> None:
    job = cases.job(case)
    proc = create(kubectl, admission, job, "alice")
    assert proc.returncode != 0, f"alice's {case.id} job was accepted"
    assert "denied request: " + expected(job) in proc.stderr, proc.stderr
    assert all(field in proc.stderr for field in case.fields)


@pytest.mark.parametrize("case", [cases.BENIGN, cases.ESCALATIONS[0]], ids=["benign", "privileged"])
def test_grpojob_creator_may_not_set_the_approval_annotation(
    admission: str, kubectl: Kubectl, case: cases.Case
) -> None:
    job = cases.job(case, annotations=APPROVED)
    proc = create(kubectl, admission, job, "alice")
    assert proc.returncode != 0
    assert "denied request: " + expected(job, approval=True) in proc.stderr, proc.stderr


def test_grpojob_creators_benign_job_is_accepted(admission: str, kubectl: Kubectl) -> None:
    proc = create(kubectl, admission, cases.job(cases.BENIGN, name="alice-benign"), "alice")
    assert proc.returncode == 0, proc.stderr
    assert kubectl("get", "grpojob", "alice-benign", "-n", admission, "--as=alice").returncode == 0


@pytest.mark.parametrize("user", ["bob", None], ids=["escalate-clusterrole", "cluster-admin"])
def test_escalate_holders_may_approve_network_privileged(
    admission: str, kubectl: Kubectl, user: str | None
) -> None:
    name = f"privileged-{user or 'admin'}"
    job = cases.job(cases.ESCALATIONS[0], name=name, annotations=APPROVED)
    proc = create(kubectl, admission, job, user)
    assert proc.returncode == 0, proc.stderr
    stored = yaml.safe_load(kubectl("get", "grpojob", name, "-n", admission, "-o", "yaml").stdout)
    assert stored["spec"]["network"]["privileged"] is True
    assert escalation.refusals(GRPOJob.model_validate(stored), stored["metadata"]["annotations"]) == []


def test_a_credentials_secret_the_requester_cannot_get_needs_escalate(
    admission: str, kubectl: Kubectl
) -> None:
    refused = create(
        kubectl, admission, cases.job(cases.CREDENTIALS_SECRET, name="alice-foreign-s3"), "alice"
    )
    assert refused.returncode != 0
    assert "spec.storage.credentialsSecret: reading Secret 'other-team-s3' needs get on it" in refused.stderr
    job = cases.job(cases.CREDENTIALS_SECRET, name="bob-foreign-s3")
    proc = create(kubectl, admission, job, "bob")  # escalate holders pass, no approval needed
    assert proc.returncode == 0, proc.stderr
    # the operator's second line cannot know the requester: it renders the job
    assert escalation.refusals(GRPOJob.model_validate(job), {}) == []


def test_without_escalate_an_approved_job_may_be_relabelled_but_not_changed(
    admission: str, kubectl: Kubectl
) -> None:
    name = "approved-by-bob"
    job = cases.job(cases.MANY, name=name, annotations=APPROVED)
    assert create(kubectl, admission, job, "bob").returncode == 0
    as_carol = ["-n", admission, "--as=carol", "--as-group=system:authenticated"]
    # Metadata only, as the operator's own patches (finalizers, kopf annotations): not matched.
    kubectl("label", "grpojob", name, "team=rl", *as_carol)
    patch = '{"spec": {"rollout": {"replicas": 2}}}'
    proc = kubectl("patch", "grpojob", name, "--type=merge", "-p", patch, *as_carol, check=False)
    assert proc.returncode != 0
    assert "denied request: " + expected(job, approval=True) in proc.stderr, proc.stderr
    assert create(kubectl, admission, cases.job(cases.BENIGN, name="carol-benign"), "carol").returncode == 0
    approve = f"{ESCALATION_APPROVED_ANNOTATION}=true"
    proc = kubectl("annotate", "grpojob", "carol-benign", approve, *as_carol, check=False)
    assert proc.returncode != 0
    assert "denied request: " + escalation.APPROVAL_REFUSAL in proc.stderr, proc.stderr


def test_the_policy_type_checks_without_warnings(
    admission: str, kubectl: Kubectl, wait_for: Callable[..., Any]
) -> None:
    name = f"adm-{admission.rsplit('-', 1)[1]}-grpo-operator-escalation"

    def status() -> dict[str, Any] | None:
        out = kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout
        found = json.loads(out).get("status", {})
        return found if "typeChecking" in found else None

    assert wait_for(status, what=f"type checking of {name}", timeout=30)["typeChecking"].get(
        "expressionWarnings"
    ) in (None, [])
