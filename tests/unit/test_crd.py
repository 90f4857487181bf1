"""The generated GRPOJob CRD: in sync with crds/, structural, defaulted, documented, and its CEL compiles."""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from grpo_operator import crd, validation
from grpo_operator.api import job, podspec
from grpo_operator.cli import main
from grpo_operator.render import names

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "crds" / "grpojobs.grpo.dev.yaml"
STRUCTURAL_KEYS = {
    "description", "type", "format", "enum", "default", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties",
    "maxProperties", "properties", "required", "additionalProperties", "items",
}  # fmt: skip


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_checked_in_crd_is_the_generator_output() -> None:
    assert CHECKED_IN.read_text() == crd.crd_yaml(), (
        "crds/grpojobs.grpo.dev.yaml is stale: run `make crd` (it also refreshes the Helm chart's copy)"
    )


def test_cli_prints_the_crd(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == crd.crd_yaml()
    assert main(["crd", "-o", str(tmp_path / "crd.yaml")]) == 0
    assert yaml.safe_load((tmp_path / "crd.yaml").read_text())["metadata"]["name"] == "grpojobs.grpo.dev"


def test_names_subresources_and_printer_columns() -> None:
    spec = crd.build_crd()["spec"]
    assert spec["names"]["shortNames"] == ["grpo"] and spec["names"]["categories"] == ["all", "ml"]
    assert spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.rollout.replicas"
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns)[:6] == ["Phase", "Step", "Reward", "Trainers", "Rollouts", "Age"]
    assert columns["Trainers"]["jsonPath"] == ".status.trainer.readyText"
    assert columns["Rollouts"]["jsonPath"] == ".status.rollout.readyText"
    wide = {"Restarts", "Tokens/s", "Eval", "Model", "RewardModels"}
    assert columns["RewardModels"]["jsonPath"] == ".status.reward.readyText"
    assert {n for n, c in columns.items() if c.get("priority") == 1} == wide


def test_schema_is_structural_and_documented(schema: dict[str, Any]) -> None:
    assert schema["properties"]["metadata"] == {"type": "object"}
    for path, node in _nodes(schema):
        extra = set(node) - STRUCTURAL_KEYS
        assert all(k.startswith("x-kubernetes-") for k in extra), f"{path}: {extra}"
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path} has no type"
        embedded = ".template.spec." in path  # the generated PodSpec: `kubectl explain pod.spec` has its docs
        if path.count(".") and not path.endswith(("[]", "{}")) and path != ".metadata" and not embedded:
            assert node.get("description"), f"{path} has no description"


def test_optional_unions_and_exclusive_bounds(schema: dict[str, Any]) -> None:
    spec = schema["properties"]["spec"]["properties"]
    assert "default" not in spec["trainer"]["properties"]["instanceType"]
    assert spec["trainer"]["properties"]["instanceType"]["type"] == "string"
    requests = spec["trainer"]["properties"]["resources"]["properties"]["requests"]
    assert requests["additionalProperties"]["x-kubernetes-int-or-string"] is True
    lr = spec["algorithm"]["properties"]["learningRate"]
    assert (lr["minimum"], lr["exclusiveMinimum"], lr["maximum"]) == (0, True, 1)
    pod_spec = spec["trainer"]["properties"]["template"]["properties"]["spec"]
    assert "x-kubernetes-preserve-unknown-fields" not in pod_spec
    port = pod_spec["properties"]["containers"]["items"]["properties"]["ports"]["items"]["properties"]
    assert port["containerPort"]["type"] == "integer" and port["protocol"]["default"] == "TCP"


def test_server_side_defaults_cover_every_default_the_pods_read(schema: dict[str, Any]) -> None:
    """The operator never writes spec: what the API server stores must already hold each default."""
    stored = {"apiVersion": job.API_VERSION, "kind": job.KIND, "metadata": {"name": "x"}}
    stored["spec"] = {
        "model": {"path": "/m"},
        "dataset": {"path": "/d.jsonl"},
        "reward": {"functions": [{"builtin": "math"}]},
    }
    validation.apply_defaults(stored, schema)
    resolved = job.GRPOJob.model_validate(stored).wire()

    def scalars(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
        if isinstance(value, dict):
            for k, v in value.items():
                yield from scalars(v, (*path, k))
        elif not isinstance(value, list):
            yield path, value

    for path, value in scalars(resolved["spec"]):
        node: Any = stored["spec"]
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        assert node == value, f"spec.{'.'.join(path)}: stored {node!r}, model default {value!r}"


def test_every_rule_compiles_and_field_paths_resolve(schema: dict[str, Any]) -> None:
    env = celpy.Environment()
    rules = 0
    for path, node in _nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            rules += 1
            env.compile(rule["rule"])
            assert rule["message"], f"{path}: rule without message"
            target = node
            for part in re.findall(r"\.([^.\[]+)", rule.get("fieldPath", "")):
                assert part in target.get("properties", {}), f"{path}: fieldPath {rule['fieldPath']}"
                target = target["properties"][part]
            if "oldSelf" in rule["rule"]:
                assert rule["rule"] == "self == oldSelf" and "immutable" in node["description"], path
    assert rules >= 10


def test_immutable_fields_are_exactly_the_topology_model_and_parameter_layout(schema: dict[str, Any]) -> None:
    immutable = {
        path
        for path, node in _nodes(schema)
        if any("oldSelf" in r["rule"] for r in node.get("x-kubernetes-validations", []))
    }
    assert immutable == {
        ".spec.model.path",
        ".spec.trainer.replicas",
        ".spec.trainer.processesPerPod",
        ".spec.trainer.expertParallelSize",
        ".spec.algorithm.routingReplay",  # MoE layers at EP = 1: another parameter order in checkpoints
    }


def test_lists_and_maps_under_rules_are_bounded(schema: dict[str, Any]) -> None:
    """Unbounded lists and maps inflate the API server's CEL cost estimate; bound them in spec."""
    for path, node in _nodes(schema["properties"]["spec"], ".spec"):
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path} needs maxItems"
        if isinstance(node.get("additionalProperties"), dict):
            assert "maxProperties" in node, f"{path} needs maxProperties"


def test_defaults_satisfy_their_own_rules(schema: dict[str, Any]) -> None:
    """The API server evaluates a default against its schema's CEL rules as written (no nested defaults)."""
    checked = 0
    for path, node in _nodes(schema):
        if "default" in node and isinstance(node["default"], dict):
            checked += 1
            problems = validation.cel_problems(node["default"], node, ("default",))
            assert problems == [], f"{path}: default {node['default']} fails {problems}"
    assert checked >= 5


def test_every_integer_has_a_maximum(schema: dict[str, Any]) -> None:
    """Integers reach datetime, RNG seeds and Kubernetes' int32/int64: none may be unbounded."""
    integers = [(p, n) for p, n in _nodes(schema) if n.get("type") == "integer"]
    assert len(integers) > 50
    for path, node in integers:
        assert "maximum" in node, f"{path} has no maximum"
        name = path.rsplit(".", 1)[-1]
        if ".template.spec." not in path and not path.startswith(".status"):
            assert str(node["maximum"]) in node["description"], f"{path}: bound not in its description"
    deadline = schema["properties"]["spec"]["properties"]["runPolicy"]["properties"]
    assert deadline["activeDeadlineSeconds"]["maximum"] == deadline["ttlSecondsAfterFinished"]["maximum"]
    assert deadline["activeDeadlineSeconds"]["maximum"] <= 10 * 366 * 86400, name


def test_template_spec_is_the_generated_pod_spec(schema: dict[str, Any]) -> None:
    """Every role (trainer, rollout, reward.model) embeds podspec.schema.json, as the CRD generator
    rewrites it, and nothing else."""
    spec = schema["properties"]["spec"]["properties"]
    expected = crd._structural(podspec.schema(), {}, "PodSpec")
    roles = {"trainer": spec["trainer"], "rollout": spec["rollout"]}
    roles["reward.model"] = spec["reward"]["properties"]["model"]
    for role, node in roles.items():
        embedded = dict(node["properties"]["template"]["properties"]["spec"])
        assert embedded.pop("description").startswith("spec: optional. A partial core/v1 PodSpec")
        assert embedded == expected, role
    assert "required" not in expected  # a partial override: the operator renders the containers
    containers = expected["properties"]["containers"]
    assert containers["items"]["required"] == ["name"] and "image" not in containers["items"]["required"]
    assert expected["properties"]["initContainers"]["items"]["required"] == ["image", "name"]
    assert not {"ephemeralContainers", "activeDeadlineSeconds"} & set(expected["properties"])
    # the sidecar-image rule's exemption is the container the renderer names after the role
    assert {
        r: r for r in (names.ROLE_TRAINER, names.ROLE_ROLLOUT, names.ROLE_REWARD)
    } == podspec.MAIN_CONTAINERS


def test_pod_spec_comes_from_the_control_planes_kubernetes_version() -> None:
    versions = (ROOT / "hack" / "versions.sh").read_text()
    k8s = re.search(r'K8S_VERSION="\$\{K8S_VERSION:-(v[0-9.]+)\}"', versions)
    assert k8s and podspec.SOURCE.startswith(f"k8s.io/kubernetes@{k8s[1]} "), (
        f"{podspec.SOURCE}: run `make podspec-schema` and `make crd` after a Kubernetes bump"
    )


def test_list_map_keys_are_required_or_defaulted(schema: dict[str, Any]) -> None:
    """The API server refuses a CRD whose list-map key may be absent from an item."""
    maps = [(p, n) for p, n in _nodes(schema) if n.get("x-kubernetes-list-type") == "map"]
    assert len(maps) > 10
    for path, node in maps:
        item = node["items"]
        for key in node["x-kubernetes-list-map-keys"]:
            assert key in item.get("required", []) or "default" in item["properties"][key], f"{path}: {key}"


def test_crd_size_stays_within_the_api_servers_limits() -> None:
    """Three embedded PodSpecs (trainer, rollout, reward.model): etcd takes 1.5 MiB, `kubectl apply`'s
    last-applied annotation 256 KiB; 240 KiB leaves that a margin."""
    compact = len(json.dumps(crd.build_crd(), separators=(",", ":")))
    assert compact < 240 * 1024, compact
    assert len(crd.crd_yaml()) < 768 * 1024  # three PodSpecs: about 630 KiB of YAML, gzipped in the chart
