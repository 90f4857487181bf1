"""The API server's OpenAPI checks for the parts of a GRPOJob the models keep as plain dicts.

Used by `grpo_operator.validation.check` for the PodSpecs embedded in the CRD
(`spec.{trainer,rollout}.template.spec`, `spec.reward.model.template.spec`, generated from the
Kubernetes OpenAPI by hack/podspec-schema.sh): the models hold them as dicts for the renderer, so
the schema check of `schema.schema_problems` cannot see inside them. Here the CRD's structural
schema is walked as kube-apiserver's validator walks it: types, int-or-string, enums, bounds,
patterns, required and unknown fields, list-map and set uniqueness, with the server's paths and
wording.
"""

import json
import re
from typing import Any

from grpo_operator.validation.yaml_docs import Path_, dotted

# The PodSpecs the CRD embeds; tests/unit/test_validation.py checks that these are all of them.
EMBEDDED: tuple[Path_, ...] = (
    ("spec", "trainer", "template", "spec"),
    ("spec", "rollout", "template", "spec"),
    ("spec", "reward", "model", "template", "spec"),
)
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":  # beyond int64 the server decodes a float, not an integer
        return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(kind, object))


def _bounds(value: Any, schema: dict[str, Any]) -> list[str]:
    """Value checks (all non-blocking on the server): ranges, lengths, patterns, sizes."""
    out = []
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"Invalid value: {value}: should be less than or equal to {schema['maximum']}")
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"Invalid value: {value}: should be greater than or equal to {schema['minimum']}")
    elif isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"Too long: may not be more than {schema['maxLength']} bytes")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"Invalid value: {_short(value)}: should match '{schema['pattern']}'")
    elif isinstance(value, list) and len(value) > schema.get("maxItems", len(value)):
        out.append(f"Too many: {len(value)}: must have at most {schema['maxItems']} items")
    elif isinstance(value, dict) and len(value) > schema.get("maxProperties", len(value)):
        out.append(f"Too many: {len(value)}: must have at most {schema['maxProperties']} items")
    return out


def structural_problems(
    value: Any, schema: dict[str, Any], path: Path_
) -> tuple[list[tuple[Path_, str]], bool]:
    """(problems, blocking) of `value` under a structural schema; blocking as the server's hasBlockingErr."""
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        if not (_type_ok(value, "integer") or isinstance(value, str)):
            return [(path, f"Invalid value: {_short(value)}: must be of type integer or string")], True
    elif kind and not _type_ok(value, kind):
        return [(path, f"Invalid value: {_short(value)}: must be of type {kind}")], True
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(json.dumps(v) for v in schema["enum"])
        return [(path, f"Unsupported value: {_short(value)}: supported values: {supported}")], True
    out = [(path, text) for text in _bounds(value, schema)]
    blocking = False
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for name in schema.get("required", []):
            if name not in value:
                out.append(((*path, name), "Required value"))
        for key, sub_value in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is None:
                if props and not schema.get("x-kubernetes-preserve-unknown-fields"):
                    out.append(((*path, key), f'unknown field "{dotted((*path, key))}"'))
                continue
            found, block = structural_problems(sub_value, sub, (*path, key))
            out += found
            blocking |= block
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found, block = structural_problems(item, schema.get("items", {}), (*path, i))
            out += found
            blocking |= block
        out += _duplicates(value, schema, path)
    return out, blocking


def _duplicates(items: list[Any], schema: dict[str, Any], path: Path_) -> list[tuple[Path_, str]]:
    """x-kubernetes-list-type map (unique keys, defaults filled) and set (unique items)."""
    list_type = schema.get("x-kubernetes-list-type")
    if list_type not in ("map", "set"):
        return []
    keys = schema.get("x-kubernetes-list-map-keys", [])
    props = schema.get("items", {}).get("properties", {})
    seen: set[str] = set()
    out = []
    for i, item in enumerate(items):
        if list_type == "map":
            if not isinstance(item, dict):
                continue
            item = {k: item.get(k, props.get(k, {}).get("default")) for k in keys}
        ident = json.dumps(item, sort_keys=True)
        if ident in seen:
            out.append(((*path, i), f"Duplicate value: {_short(item)}"))
        seen.add(ident)
    return out


def embedded_problems(obj: dict[str, Any], schema: dict[str, Any]) -> tuple[list[tuple[Path_, str]], bool]:
    """Problems of the embedded PodSpecs of a (defaulted) GRPOJob, checked against the CRD's schema."""
    out: list[tuple[Path_, str]] = []
    blocking = False
    for path in EMBEDDED:
        value: Any = obj
        node: dict[str, Any] | None = schema
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
            node = (node or {}).get("properties", {}).get(part)
        if isinstance(value, dict) and node is not None:  # a non-dict is the models' to report
            found, block = structural_problems(value, node, path)
            out += found
            blocking |= block
    return out, blocking
