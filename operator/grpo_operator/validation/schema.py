"""The API server's structural steps before CEL: defaulting, null pruning, the schema, ObjectMeta.

Used by `grpo_operator.validation.check`. The schema check is the pydantic models the CRD is
generated from, in strict mode (no '8' for 8), with pydantic's errors turned into the API
server's paths and wording; `blocking` says whether the server would still run CEL rules.
"""

import copy
import json
import re
from typing import Any

from pydantic import ValidationError

from grpo_operator.api import job
from grpo_operator.validation.yaml_docs import Path_, dotted

# The API server skips CEL rules when the schema check failed with one of these (hasBlockingErr).
_NON_BLOCKING = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of"}
_NON_BLOCKING |= {"string_pattern_mismatch", "string_too_short", "too_short"}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def apply_defaults(value: Any, schema: dict[str, Any]) -> None:
    """The API server's structural defaulting and null pruning (defaulting/algorithm.go, prunenulls.go)."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key, sub in props.items():
            if "default" in sub and value.get(key) is None:
                value[key] = copy.deepcopy(sub["default"])
        for key in list(value):
            sub = props.get(key, schema.get("additionalProperties"))
            if not isinstance(sub, dict):
                continue
            if value[key] is None and not sub.get("nullable"):
                del value[key]
            else:
                apply_defaults(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])


def not_int64(value: Any) -> bool:
    """An integer JSON number the API server cannot hold as int64 (it decodes it as a float instead)."""
    return isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63


def schema_problems(obj: dict[str, Any]) -> tuple[list[tuple[Path_, str]], bool]:
    """Types, bounds, enums, required and unknown fields, by the models in strict (API server) mode."""
    try:
        job.GRPOJob.model_validate_json(json.dumps(obj), strict=True)
    except ValidationError as err:
        found: dict[Path_, tuple[str, list[str]]] = {}
        blocking = False
        for e in err.errors():
            path = _loc_path(e["loc"], obj)
            beyond = not_int64(e["input"])  # the server decodes it as a float: a type error, blocking
            blocking |= e["type"] not in _NON_BLOCKING or beyond
            if beyond:
                head, text = f"Invalid value: {_short(e['input'])}", "must be of type integer"
            elif e["type"] == "extra_forbidden":
                head, text = f'unknown field "{dotted(path)}"', ""
            elif e["type"] == "missing":
                head, text = "Required value", ""
            else:
                head, text = f"Invalid value: {_short(e['input'])}", e["msg"][0].lower() + e["msg"][1:]
            texts = found.setdefault(path, (head, []))[1]
            if text and text not in texts:
                texts.append(text)
        return [
            (p, ": ".join([head, " or ".join(t)]) if t else head) for p, (head, t) in found.items()
        ], blocking
    return [], False


def _short(value: Any) -> str:
    """A value as JSON, cut short: a 17-item list need not be printed whole to say it has too many."""
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _loc_path(loc: tuple[str | int, ...], data: Any) -> Path_:
    """A pydantic error location without its union tags ('str', 'int', model names)."""
    path: list[str | int] = []
    for i, part in enumerate(loc):
        present = isinstance(data, dict) and part in data
        indexed = isinstance(data, list) and isinstance(part, int) and part < len(data)
        if present or indexed:
            data = data[part]  # type: ignore[index]
        elif isinstance(data, dict) and i == len(loc) - 1:
            data = None  # a missing field: the last element names it
        else:
            continue
        path.append(part)
    return tuple(path)


_OBJECT_META = {
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations",
    "ownerReferences", "finalizers", "managedFields",
}  # fmt: skip
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def _qualified_name(key: str) -> bool:
    """A label or annotation key: [DNS-subdomain prefix/]name, the name at most 63 characters."""
    prefix, slash, name = key.rpartition("/")
    good_prefix = not slash or (len(prefix) <= 253 and _DNS_SUBDOMAIN.match(prefix) is not None)
    return good_prefix and 0 < len(name) <= 63 and _QUALIFIED.match(name) is not None


def metadata_problems(meta: dict[str, Any]) -> list[tuple[Path_, str]]:
    """The API server's ObjectMeta checks that a manifest can get wrong: names, labels, annotations."""
    out: list[tuple[Path_, str]] = []
    for key in meta:
        if key not in _OBJECT_META:
            out.append((("metadata", key), f'unknown field "metadata.{key}"'))
    for key in ("name", "namespace"):
        value = meta.get(key)
        limit = 253 if key == "name" else 63
        if value is not None and (
            not isinstance(value, str) or len(value) > limit or not _DNS_SUBDOMAIN.match(value)
        ):
            out.append((("metadata", key), f"Invalid value: {json.dumps(value)}: a lowercase RFC 1123 name"))
    for kind in ("labels", "annotations"):
        entries = meta.get(kind) or {}
        if not isinstance(entries, dict):
            out.append((("metadata", kind), f"Invalid value: {_short(entries)}: must be a map of strings"))
            continue
        for key, value in entries.items():  # the server names the map, not the key
            where = ("metadata", kind)
            if not _qualified_name(key):
                out.append((where, f"Invalid value: {json.dumps(key)}: not a qualified name"))
            if not isinstance(value, str):
                out.append((where, f"Invalid value: {_short(value)} (key {key!r}): must be a string"))
            elif kind == "labels" and value and (len(value) > 63 or not _QUALIFIED.match(value)):
                out.append(
                    (where, f"Invalid value: {json.dumps(value)} (key {key!r}): not a valid label value")
                )
    return out
