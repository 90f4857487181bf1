"""Offline validation: the invalid-manifest corpus, forbidden updates, examples, lines and the CLI."""

from pathlib import Path

import pytest
import yaml
from grpo_operator import crd, validation
from grpo_operator.cli import main
from grpo_operator.validation import structural

from tests.support import example_mutations

ROOT = Path(__file__).resolve().parents[2]
INVALID = sorted((ROOT / "tests" / "fixtures" / "invalid").glob("*.yaml"))
# Valid to the API server, refused by the operator's renderer against the instance-type table, which
# `validate` runs offline too: the same first line names the field.
RENDER_REFUSED = sorted((ROOT / "tests" / "fixtures" / "render-refused").glob("*.yaml"))
UPDATES = sorted((ROOT / "tests" / "fixtures" / "updates").glob("*.new.yaml"))
# GRPOJob examples only: the EKS infrastructure files are checked by tests/unit/test_examples.py.
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "kind: GRPOJob" in p.read_text())

JOB = """\
apiVersion: grpo.dev/v1alpha1
kind: GRPOJob
metadata:
  name: tiny
spec:
  model:
    path: /models/tiny
  dataset:
    path: /data/prompts.jsonl
  reward:
    functions:
      - builtin: exact_match
  trainer:
    replicas: 2
    processesPerPod: 2
  rollout:
    replicas: 2
  checkpoint:
    path: s3://checkpoints/tiny
"""
TRAINER = "  trainer:\n    replicas: 2"
ROLLOUT = "  rollout:\n    replicas: 2"


def expected(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), (
        f"{path.name}: first line must be '# expect: <field path fragment>'"
    )
    return first.removeprefix("# expect: ").strip()


def test_corpus_is_large_and_distinct() -> None:
    assert len(INVALID) >= 25
    bodies = {p.read_text().split("\n", 2)[2] for p in INVALID}
    assert len(bodies) == len(INVALID), "two fixtures hold the same manifest"
    assert len(UPDATES) >= 4


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_manifest_is_rejected_naming_the_field(path: Path) -> None:
    problems = validation.validate_file(path)
    assert problems, f"{path.name} was accepted"
    fragment = expected(path)
    assert any(fragment in str(p) for p in problems), f"{fragment!r} not in {[str(p) for p in problems]}"


@pytest.mark.parametrize("path", RENDER_REFUSED, ids=lambda p: p.stem)
def test_what_the_renderer_refuses_is_refused_offline_naming_the_field(path: Path) -> None:
    assert not validation.validate_text(path.read_text(), str(path)), "the API server's checks pass"
    problems = validation.validate_file(path)
    fragment = expected(path)
    assert any(fragment in str(p) for p in problems), f"{fragment!r} not in {[str(p) for p in problems]}"


@pytest.mark.parametrize("new", UPDATES, ids=lambda p: p.name.removesuffix(".new.yaml"))
def test_forbidden_update_is_rejected_only_as_an_update(new: Path) -> None:
    old = new.with_name(new.name.replace(".new.", ".old."))
    assert validation.validate_file(old) == []
    assert validation.validate_file(new) == [], "the new object alone must be valid: only the change is wrong"
    problems = validation.validate_file(new, old=old)
    fragment = expected(new)
    assert [p.path for p in problems] == [fragment], [str(p) for p in problems]
    assert "immutable" in problems[0].message


def test_mutable_fields_may_change() -> None:
    changed = JOB.replace(ROLLOUT, "  rollout:\n    replicas: 5").replace("exact_match", "math")
    assert validation.validate_text(changed, "new.yaml", old_text=JOB) == []


def test_update_of_another_job_is_a_create() -> None:
    other = JOB.replace("name: tiny", "name: other").replace(TRAINER, "  trainer:\n    replicas: 4")
    assert validation.validate_text(other, "new.yaml", old_text=JOB) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_examples_are_valid(path: Path) -> None:
    assert validation.validate_file(path) == []


def test_an_environment_job_may_leave_reward_out() -> None:
    """Issue 46: leaving spec.reward out is refused only when nothing else scores (one CEL rule)."""
    env_only = JOB.replace(
        "  reward:\n    functions:\n      - builtin: exact_match\n", "  environment:\n    class: a:B\n"
    )
    assert "reward" not in env_only and validation.validate_text(env_only, "env.yaml") == []
    neither = env_only.replace("  environment:\n    class: a:B\n", "")
    [problem] = validation.validate_text(neither, "neither.yaml")
    assert "spec.reward.functions" in str(problem) and "unless reward.model or spec.environment" in str(
        problem
    )


def test_problem_names_file_line_and_path() -> None:
    text = JOB.replace("    processesPerPod: 2\n", "    processesPerPod: 2\n    expertParallelSize: 3\n")
    (problem,) = validation.validate_text(text, "job.yaml")
    assert str(problem).startswith("job.yaml:16: spec.trainer.expertParallelSize: ")
    assert text.splitlines()[15].strip() == "expertParallelSize: 3"


def test_absent_field_reports_at_its_parent_line() -> None:
    (problem,) = validation.validate_text(JOB.replace("path: /models/tiny", "dtype: float32"), "job.yaml")
    assert (problem.line, problem.path, problem.message) == (6, "spec.model.path", "Required value")


def test_bad_yaml_names_its_line() -> None:
    (problem,) = validation.validate_text(JOB + "  oops: [1, 2\n", "broken.yaml")
    assert problem.path == "<yaml>" and problem.line >= 18 and "invalid YAML" in problem.message


def test_unreadable_yaml_is_a_problem_not_a_crash() -> None:
    (problem,) = validation.validate_text("a: b\nc: \x01\n", "ctl.yaml")
    assert (problem.line, problem.path) == (2, "<yaml>") and "unacceptable character" in problem.message
    binary = JOB.split("spec:\n")[0] + "spec: !!binary aGVsbG8=\n"
    (problem,) = validation.validate_text(binary, "bin.yaml")
    assert problem.path == "spec" and "aGVsbG8=" in problem.message


def test_other_kinds_are_skipped_but_a_file_needs_a_job() -> None:
    config_map = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\ndata:\n  a: b\n"
    assert validation.validate_text(f"{config_map}---\n{JOB}", "both.yaml") == []
    (problem,) = validation.validate_text(config_map, "cm.yaml")
    assert "no GRPOJob" in problem.message


def test_generated_names_are_checked_as_the_server_generates_them() -> None:
    short = JOB.replace("  name: tiny", "  generateName: run-")
    assert validation.validate_text(short) == []
    (problem,) = validation.validate_text(JOB.replace("  name: tiny", f"  generateName: {'g' * 40}-"))
    assert "metadata.name must be a DNS-1035 label" in problem.message


@pytest.mark.parametrize(
    ("metadata", "path"),
    [
        ("  labels: {app: bad value}", "metadata.labels"),
        ("  labels: {/app: x}", "metadata.labels"),
        ("  annotations: {note: 5}", "metadata.annotations"),
        ("  owner: me", "metadata.owner"),
    ],
)
def test_object_metadata_is_checked_as_the_server_does(metadata: str, path: str) -> None:
    (problem,) = validation.validate_text(JOB.replace("  name: tiny\n", f"  name: tiny\n{metadata}\n"))
    assert problem.path == path
    assert (
        validation.validate_text(JOB.replace("  name: tiny\n", "  name: tiny\n  labels: {team: ml}\n")) == []
    )


def test_wrong_api_version_is_rejected() -> None:
    (problem,) = validation.validate_text(JOB.replace("grpo.dev/v1alpha1", "grpo.dev/v1"), "v1.yaml")
    assert "grpo.dev/v1alpha1" in problem.message


def test_yaml_floats_with_integer_values_are_integers_as_kubectl_sends_them() -> None:
    assert validation.validate_text(JOB.replace(ROLLOUT, "  rollout:\n    replicas: 2.0")) == []
    (problem,) = validation.validate_text(JOB.replace(ROLLOUT, "  rollout:\n    replicas: 2.5"))
    assert problem.path == "spec.rollout.replicas"


def test_exponent_without_a_dot_is_a_number_as_kubectl_reads_it() -> None:
    text = JOB.replace(
        "kind: GRPOJob\n", "kind: GRPOJob\n# 1e-6 is a float for kubectl; YAML 1.1 would say string\n"
    )
    assert validation.validate_text(text + "  algorithm:\n    learningRate: 1e-6\n") == []
    (problem,) = validation.validate_text(text + '  algorithm:\n    learningRate: "1e-6"\n')
    assert problem.path == "spec.algorithm.learningRate"
    assert yaml.safe_load("x: 1e-6")["x"] == "1e-6"  # what plain PyYAML would have judged


def test_rules_come_from_the_schema_given() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "xs": {"type": "array", "items": {"type": "number"}}},
        "x-kubernetes-validations": [
            {"rule": "self.a > 1", "message": "a must exceed 1", "fieldPath": ".a"},
            {"rule": "self.xs.all(x, x < 2.5)", "message": "xs below 2.5"},
        ],
    }
    assert validation.cel_problems({"a": 2, "xs": [1, 2]}, schema) == []
    assert validation.cel_problems({"a": 1, "xs": [3]}, schema) == [
        (("a",), "a must exceed 1"),
        ((), "xs below 2.5"),
    ]


def test_transition_rules_correlate_map_list_items_by_key() -> None:
    item = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
        "x-kubernetes-validations": [{"rule": "self.size == oldSelf.size", "message": "size is immutable"}],
    }
    schema = {
        "type": "array",
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    }
    old = [{"name": "a", "size": 1}, {"name": "b", "size": 2}]
    new = [{"name": "b", "size": 2}, {"name": "a", "size": 5}, {"name": "c", "size": 9}]
    assert validation.cel_problems(new, schema, ("xs",), old, True) == [(("xs", 1), "size is immutable")]


def test_cli_exit_codes_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(JOB)
    assert main(["validate", str(good)]) == 0
    assert capsys.readouterr().out == f"{good}: valid\n"
    bad = INVALID[0]
    assert main(["validate", str(good), str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:") and expected(bad) in err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_cli_old_flag_checks_updates(capsys: pytest.CaptureFixture[str]) -> None:
    new = UPDATES[0]
    assert main(["validate", str(new)]) == 0
    assert main(["validate", str(new), "--old", str(new.with_name(new.name.replace(".new.", ".old.")))]) == 1
    assert "immutable" in capsys.readouterr().err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_each_field_of_each_example_broken_alone_is_refused_naming_it(path: Path) -> None:
    """Wrong types, unknown fields, numbers past their bounds, PodSpec mistakes in template.spec."""
    cases = [m for m in example_mutations.mutations() if m.example == path.name]
    assert len(cases) > 2 * len(example_mutations.TEMPLATE_CASES)
    missed = []
    for case in cases:
        problems = validation.check_object(case.doc)
        if not any(validation.dotted(where) == case.field for where, _ in problems):
            missed.append(f"{case.change} at {case.field}: {problems}")
    assert not missed, "\n".join(missed)


@pytest.mark.parametrize("role", ["trainer", "rollout"])
@pytest.mark.parametrize("override", example_mutations.VALID_TEMPLATES, ids=lambda o: ",".join(o))
def test_partial_template_overrides_stay_valid(role: str, override: dict) -> None:
    job = yaml.safe_load(JOB)
    job["spec"][role]["template"] = {"spec": example_mutations.with_main(override, role)}
    assert validation.check_object(job) == []


def test_template_spec_problems_name_file_line_and_field() -> None:
    template = "    template:\n      spec:\n        containers:\n          - name: {x: 1}\n"
    text = JOB.replace(TRAINER, f"{TRAINER}\n{template.rstrip()}")
    (problem,) = validation.validate_text(text, "job.yaml")
    assert str(problem) == (
        'job.yaml:18: spec.trainer.template.spec.containers[0].name: Invalid value: {"x": 1}: '
        "must be of type string"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("activeDeadlineSeconds", 300000000000),  # passed the CRD, then OverflowError in the operator
        ("ttlSecondsAfterFinished", 10**12),
        ("activeDeadlineSeconds", 10**19),  # past int64: the server reads a float, a type error
    ],
)
def test_durations_past_their_maximum_are_refused(field: str, value: int) -> None:
    (problem,) = validation.validate_text(JOB + f"  runPolicy:\n    {field}: {value}\n")
    assert problem.path == f"spec.runPolicy.{field}" and str(value) in problem.message
    if value >= 2**63:
        assert problem.message.endswith("must be of type integer")


def test_sidecars_need_an_image_but_the_main_container_does_not() -> None:
    main = (
        "    template:\n      spec:\n        containers:\n          - name: trainer\n            tty: true\n"
    )
    assert validation.validate_text(JOB.replace(TRAINER, f"{TRAINER}\n{main.rstrip()}")) == []
    sidecar = main.replace("name: trainer", "name: logs")
    (problem,) = validation.validate_text(JOB.replace(TRAINER, f"{TRAINER}\n{sidecar.rstrip()}"))
    assert problem.path == "spec.trainer.template.spec.containers"
    assert problem.message == "a container other than 'trainer' needs an image"


def test_embedded_pod_specs_are_the_ones_checked_structurally() -> None:
    schema = crd.openapi_schema()

    def pod_specs(node: dict, path: tuple = ()) -> list[tuple]:
        here = [path] if "containers" in node.get("properties", {}) else []
        return here + [p for k, sub in node.get("properties", {}).items() for p in pod_specs(sub, (*path, k))]

    assert sorted(pod_specs(schema)) == sorted(structural.EMBEDDED)
