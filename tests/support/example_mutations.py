"""Invalid GRPOJobs made from the shipped examples, one broken field each, and the field to blame.

Shared by tests/unit/test_validation.py (offline `validate` must refuse each) and
tests/e2e/test_crd_server.py (the API server must refuse the same ones). Every spec field an
example sets gets a wrong type, every object an unknown field, every bounded number a value
past its bound; `template.spec` of both roles gets the PodSpec mistakes of TEMPLATE_CASES.
"""

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_operator import crd, validation

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "kind: GRPOJob" in p.read_text())
UNKNOWN = "bogusField"
MAIN = "<main>"  # stands for the role's own container name in TEMPLATE_CASES

# (template.spec override, the path under template.spec that a refusal must name)
TEMPLATE_CASES: tuple[tuple[dict[str, Any], str], ...] = (
    ({"containers": [{"name": {"x": 1}}]}, "containers[0].name"),
    ({"containers": [{"name": MAIN, UNKNOWN: 1}]}, f"containers[0].{UNKNOWN}"),
    ({"containers": [{"name": MAIN, "env": ["NCCL_DEBUG=INFO"]}]}, "containers[0].env[0]"),
    ({"containers": [{"name": MAIN, "env": [{"name": "A", "value": 5}]}]}, "containers[0].env[0].value"),
    ({"containers": [{"name": MAIN, "env": [{"value": "x"}]}]}, "containers[0].env[0].name"),
    ({"containers": [{"image": "busybox:1.36"}]}, "containers[0].name"),
    ({"containers": [{"name": "sidecar", "command": ["sleep", "1d"]}]}, "containers"),
    ({"containers": [{"name": MAIN}, {"name": MAIN}]}, "containers[1]"),
    (
        {"containers": [{"name": MAIN, "ports": [{"containerPort": 70000}]}]},
        "containers[0].ports[0].containerPort",
    ),
    (
        {"containers": [{"name": MAIN, "resources": {"limits": {"cpu": {"x": 1}}}}]},
        "containers[0].resources.limits.cpu",
    ),
    ({"initContainers": [{"name": "init"}]}, "initContainers[0].image"),
    ({"priority": 2**31}, "priority"),
    ({"terminationGracePeriodSeconds": 10**19}, "terminationGracePeriodSeconds"),
    ({"activeDeadlineSeconds": 60}, "activeDeadlineSeconds"),
    ({"restartPolicy": "Never"}, "restartPolicy"),
    ({"hostNetwork": "yes"}, "hostNetwork"),
    ({"nodeSelector": {"zone": 1}}, "nodeSelector.zone"),
    ({"securityContext": {"runAsUser": "root"}}, "securityContext.runAsUser"),
    ({"tolerations": [{"key": "k", "tolerationSeconds": "1h"}]}, "tolerations[0].tolerationSeconds"),
    ({"volumes": [{"name": "v", "emptyDir": {"sizeLimit": "lots"}}]}, "volumes[0].emptyDir.sizeLimit"),
    ({"volumes": [{"name": "v", "emptyDir": {}}, {"name": "v", "emptyDir": {}}]}, "volumes[1]"),
    ({"volumes": [{"name": "v", "hostPath": {"path": "/x", "type": 3}}]}, "volumes[0].hostPath.type"),
    ({UNKNOWN: 1}, UNKNOWN),
)
# Partial overrides users write: each must stay valid (no PodSpec field is required of them).
VALID_TEMPLATES: tuple[dict[str, Any], ...] = (
    {"containers": [{"name": MAIN, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}]},
    {"containers": [{"name": "sidecar", "image": "busybox:1.36", "ports": [{"containerPort": 9000}]}]},
    {"volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}]},
    {
        "imagePullSecrets": [{"name": "regcred"}],
        "priorityClassName": "batch",
        "terminationGracePeriodSeconds": 60,
    },
    {"containers": [{"name": MAIN, "resources": {"limits": {"cpu": 4, "memory": "16Gi"}}}]},
)


@dataclass(frozen=True)
class Mutation:
    """One example with one field broken; `field` is the dotted path a refusal must name."""

    name: str
    example: str
    change: str
    field: str
    doc: dict[str, Any]


def jobs(path: Path) -> list[dict[str, Any]]:
    """The GRPOJobs of an example file, as kubectl reads them."""
    docs, problems = validation.load_documents(path.read_text(), str(path))
    assert not problems, problems
    return [d.data for d in docs if validation.is_grpojob(d.data)]


def _wrong_type(value: Any, schema: dict[str, Any]) -> Any:
    """A value of a type the schema refuses: strings and int-or-strings get an object, the rest a string."""
    if isinstance(value, dict):
        return "x"
    if isinstance(value, str | list) or schema.get("x-kubernetes-int-or-string"):
        return {"x": 1}
    return "8"  # a number or boolean written as a string: strict schemas refuse it


def _past_bounds(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    if schema.get("type") not in ("integer", "number"):
        return
    if "maximum" in schema:
        yield "above maximum", schema["maximum"] if schema.get("exclusiveMaximum") else schema["maximum"] + 1
    if "minimum" in schema:
        yield "below minimum", schema["minimum"] if schema.get("exclusiveMinimum") else schema["minimum"] - 1


def _field_cases(
    value: Any, schema: dict[str, Any], path: tuple[str | int, ...]
) -> Iterator[tuple[tuple, str, Any]]:
    """(path, change, new value) for every field under `path` that the example sets."""
    if len(path) > 1:  # `spec` itself stays an object
        yield path, "wrong type", _wrong_type(value, schema)
        for change, bad in _past_bounds(schema):
            yield path, change, bad
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if props:  # a struct, not a map: an unknown field is refused
            yield (*path, UNKNOWN), "unknown field", 1
        for key, sub in value.items():
            sub_schema = props.get(key, schema.get("additionalProperties"))
            if isinstance(sub_schema, dict):
                yield from _field_cases(sub, sub_schema, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _field_cases(item, schema.get("items", {}), (*path, i))


def _set(doc: dict[str, Any], path: tuple, value: Any) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def mutations() -> list[Mutation]:
    """Every mutation of every shipped example, named mut-0, mut-1, ... (unique in one namespace)."""
    spec_schema = crd.openapi_schema()["properties"]["spec"]
    out: list[Mutation] = []

    def add(example: Path, job: dict[str, Any], change: str, field: str, doc: dict[str, Any]) -> None:
        doc["metadata"] = {"name": f"mut-{len(out)}"}
        out.append(Mutation(doc["metadata"]["name"], example.name, change, field, doc))

    for example in EXAMPLES:
        for job in jobs(example):
            for path, change, bad in _field_cases(job["spec"], spec_schema, ("spec",)):
                doc = copy.deepcopy(job)
                _set(doc, path, bad)
                add(example, job, f"{change} {bad!r}", validation.dotted(path), doc)
            for role in ("trainer", "rollout"):
                for override, field in TEMPLATE_CASES:
                    doc = copy.deepcopy(job)
                    template = doc["spec"].setdefault(role, {}).setdefault("template", {})
                    template["spec"] = with_main(override, role)
                    change = f"template.spec {json.dumps(override)}"
                    add(example, job, change, f"spec.{role}.template.spec.{field}", doc)
    return out


def with_main(override: Any, role: str) -> Any:
    """The override with MAIN replaced by the role's own container name."""
    if isinstance(override, dict):
        return {k: with_main(v, role) for k, v in override.items()}
    if isinstance(override, list):
        return [with_main(v, role) for v in override]
    return role if override == MAIN else override
