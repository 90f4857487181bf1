"""Escalations: `validation.escalation.refusals` and the chart's admission policy agree, case by case.

The policy's CEL (charts/grpo-operator/templates/admission-policy.yaml, rendered by the real helm)
is evaluated with cel-python on the object the API server would see (CRD defaults applied): its
`variables.refusals` must be exactly the Python refusals, in order, plus the approval-annotation
refusal when the annotation is set. The requester's rights (`authorizer`) are a stand-in here that
may get exactly `cases.READABLE_SECRETS`, and Python's `may_get_secret` says the same; the e2e
test holds the real authorizer, and these messages, to a real API server.
"""

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes
from grpo_operator import crd
from grpo_operator.api.job import ESCALATION_APPROVED_ANNOTATION, GRPOJob
from grpo_operator.validation import escalation, validate_text
from grpo_operator.validation.check import escalation_warnings
from grpo_operator.validation.schema import apply_defaults

from tests.support import escalation_cases as cases
from tests.support.chart import HELM, render

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "kind: GRPOJob" in p.read_text())
needs_helm = pytest.mark.skipif(not HELM.exists(), reason="helm not built yet (make control-plane)")
_ENV = celpy.Environment()


def python_refusals(obj: dict[str, Any]) -> list[str]:
    meta = obj.get("metadata", {})
    return escalation.refusals(
        GRPOJob.model_validate(obj),
        meta.get("annotations", {}),
        may_get_secret=lambda name: name in cases.READABLE_SECRETS,
    )


def policy() -> dict[str, Any]:
    (found,) = [d for d in render() if d["kind"] == "ValidatingAdmissionPolicy"]
    return found


_POLICY: dict[str, Any] = {}


def _authorizer_step(key: str) -> Any:
    def step(check: Any, arg: Any) -> Any:
        return celtypes.MapType({**check, celtypes.StringType(key): arg})

    return step


# A stand-in for the API server's `authorizer`: the chain `.group().resource().namespace().name()
# .check(verb)` builds a map, `.allowed()` answers it: get on the Secrets in READABLE_SECRETS only.
AUTHORIZER_FUNCTIONS = {k: _authorizer_step(k) for k in ("group", "resource", "namespace", "name", "check")}
AUTHORIZER_FUNCTIONS["join"] = lambda items, sep: celtypes.StringType(
    str(sep).join(map(str, items))
)  # k8s strings lib
AUTHORIZER_FUNCTIONS["allowed"] = lambda c: celtypes.BoolType(
    {str(k): str(v) for k, v in c.items()}
    in [
        {"group": "", "resource": "secrets", "namespace": "ml", "name": n, "check": "get"}
        for n in cases.READABLE_SECRETS
    ]
)


def cel_eval(expression: str, activation: dict[str, Any]) -> Any:
    program = _ENV.program(_ENV.compile(expression), functions=AUTHORIZER_FUNCTIONS)
    result = program.evaluate(activation)
    assert not isinstance(result, celpy.CELEvalError), f"{expression[:200]}...: {result}"
    return result


def policy_refusals(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """`variables.refusals` of the chart's policy for `obj`, as the API server computes it."""
    if not _POLICY:
        _POLICY.update(policy())
    new = copy.deepcopy(obj)
    apply_defaults(new, crd.openapi_schema())
    variables = celtypes.MapType({})
    activation = {
        "object": celpy.json_to_cel(new),
        "oldObject": celpy.json_to_cel(old),
        "variables": variables,
        "request": celpy.json_to_cel({"operation": "CREATE", "namespace": "ml"}),
        "authorizer": celtypes.MapType({}),
    }
    for var in _POLICY["spec"]["variables"]:
        variables[celtypes.StringType(var["name"])] = cel_eval(var["expression"], activation)
    out = [str(m) for m in variables[celtypes.StringType("refusals")]]
    for check in _POLICY["spec"]["validations"][1:]:  # the requester-dependent ones
        if not cel_eval(check["expression"], activation):
            out.append(str(cel_eval(check["messageExpression"], activation)))
    return out


ALL = [*cases.ESCALATIONS, cases.MANY, cases.BENIGN]


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_refusals_name_each_field_in_order(case: cases.Case) -> None:
    found = python_refusals(cases.job(case))
    assert [m.split(": ", 1)[0] for m in found] == list(case.fields)
    assert all(m.endswith(escalation.PERMISSION) for m in found)


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_approval_annotation_clears_refusals_only_when_true(case: cases.Case) -> None:
    assert python_refusals(cases.job(case, annotations={ESCALATION_APPROVED_ANNOTATION: "true"})) == []
    no = cases.job(case, annotations={ESCALATION_APPROVED_ANNOTATION: "yes"})
    assert python_refusals(no) == python_refusals(cases.job(case))


@needs_helm
@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_policy_cel_gives_the_same_refusals(case: cases.Case) -> None:
    obj = cases.job(case)
    assert policy_refusals(obj) == python_refusals(obj)


@needs_helm
@pytest.mark.parametrize("case", [cases.ESCALATIONS[0], cases.BENIGN], ids=["escalating", "benign"])
def test_policy_refuses_the_approval_annotation_and_still_names_the_spec(case: cases.Case) -> None:
    obj = cases.job(case, annotations={ESCALATION_APPROVED_ANNOTATION: "true"})
    assert policy_refusals(obj) == [escalation.APPROVAL_REFUSAL, *python_refusals(cases.job(case))]


@needs_helm
@pytest.mark.parametrize("kind", escalation.FORBIDDEN_VOLUMES)
def test_policy_and_python_refuse_the_same_volume_sources(kind: str) -> None:
    obj = cases.job(
        cases.Case(
            kind, {"spec": {"rollout": {"template": {"spec": {"volumes": [{"name": "v", kind: {}}]}}}}}
        )
    )
    expected = f"spec.rollout.template.spec.volumes[v].{kind}: {kind} volumes need {escalation.PERMISSION}"
    assert policy_refusals(obj) == python_refusals(obj) == [expected]


@needs_helm
def test_policy_matches_creates_and_updates_that_change_spec_or_approval_only() -> None:
    (changes, requester) = policy()["spec"]["matchConditions"]
    assert "authorizer.group('grpo.dev').resource('grpojobs')" in requester["expression"]
    assert ".check('escalate').allowed()" in requester["expression"]
    old = cases.job(cases.ESCALATIONS[0], annotations={ESCALATION_APPROVED_ANNOTATION: "true"})

    def matches(operation: str, new: dict[str, Any]) -> bool:
        activation = {
            "request": celpy.json_to_cel({"operation": operation}),
            "object": celpy.json_to_cel(new),
            "oldObject": celpy.json_to_cel(old if operation == "UPDATE" else None),
        }
        return bool(cel_eval(changes["expression"], activation))

    assert matches("CREATE", old)
    metadata_only = copy.deepcopy(old)
    metadata_only["metadata"].update(finalizers=["kopf.zalando.org/KopfFinalizerMarker"], labels={"a": "b"})
    assert not matches("UPDATE", metadata_only), "the operator's metadata patches pass untouched"
    spec_change = copy.deepcopy(old)
    spec_change["spec"]["rollout"] = {"replicas": 3}
    assert matches("UPDATE", spec_change)
    unapproved = copy.deepcopy(old)
    del unapproved["metadata"]["annotations"]
    assert matches("UPDATE", unapproved)
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["annotations"][ESCALATION_APPROVED_ANNOTATION] = "yes"
    assert matches("UPDATE", relabelled)


@needs_helm
def test_policy_binding_and_escalate_role_ship_by_default_and_switch_off() -> None:
    docs = render()
    by_kind = {
        d["kind"]: d
        for d in docs
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "admission"
    }
    assert set(by_kind) == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "ClusterRole"}
    vap, binding, role = (
        by_kind["ValidatingAdmissionPolicy"],
        by_kind["ValidatingAdmissionPolicyBinding"],
        by_kind["ClusterRole"],
    )
    assert vap["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    assert vap["spec"]["failurePolicy"] == "Fail"
    assert role["rules"] == [{"apiGroups": ["grpo.dev"], "resources": ["grpojobs"], "verbs": ["escalate"]}]
    assert "-escalate" in role["metadata"]["name"]
    assert "ValidatingAdmissionPolicy" not in str(render("admissionPolicy.enabled=false"))
    warn = render("admissionPolicy.validationActions={Warn,Audit}")
    (binding,) = [d for d in warn if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["validationActions"] == ["Warn", "Audit"]


def test_python_cannot_know_the_requester_so_it_refuses_no_secret_read_without_an_authorizer() -> None:
    obj = cases.job(cases.CREDENTIALS_SECRET)
    model = GRPOJob.model_validate(obj)
    assert escalation.secret_reads(model) == [("spec.storage.credentialsSecret", "other-team-s3")]
    assert escalation.refusals(model, {}) == []  # the operator's second line and validate
    refused = escalation.refusals(model, {}, may_get_secret=lambda _: False)
    prefix = "spec.storage.credentialsSecret: reading Secret 'other-team-s3' needs get on it or "
    assert refused == [prefix + escalation.PERMISSION]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_shipped_examples_ask_for_nothing_beyond_grpojob_create(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "GRPOJob":
            assert python_refusals(doc) == []


def test_validate_reports_escalations_as_warnings_with_lines() -> None:
    text = yaml.safe_dump(cases.job(cases.MANY), sort_keys=False)
    assert validate_text(text, "job.yaml") == [], "an escalation is a warning, not a schema problem"
    warnings = escalation_warnings(text, "job.yaml")
    assert [w.path for w in warnings] == list(cases.MANY.fields)
    privileged = warnings[0]
    assert privileged.line == text.splitlines().index("    privileged: true") + 1
    assert privileged.message == f"privileged containers need {escalation.PERMISSION}"
    approved = yaml.safe_dump(cases.job(cases.MANY, annotations={ESCALATION_APPROVED_ANNOTATION: "true"}))
    assert escalation_warnings(approved, "job.yaml") == []
