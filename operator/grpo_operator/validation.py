"""Offline validation of GRPOJob manifests that reaches the API server's verdicts.

Called by `grpo-operator validate` and by the tests that hold it to a real API server.
It follows kube-apiserver's steps for a custom resource, in order: YAML to JSON (as
kubectl converts it), non-nullable nulls pruned and schema defaults applied from the
generated CRD, the OpenAPI schema checked (by the pydantic models the schema is generated
from, in strict mode: no '8' for 8), then every `x-kubernetes-validations` rule of the CRD
evaluated with cel-python on the defaulted object; transition rules (`oldSelf`) only when
an old object is given. Rules are read from the CRD, never re-implemented here.
"""

import base64
import copy
import functools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy import celtypes
from pydantic import ValidationError

from grpo_operator import crd
from grpo_operator.api import job

Path_ = tuple[str | int, ...]
CEL_KEY = "x-kubernetes-validations"
# The API server skips CEL rules when the schema check failed with one of these (hasBlockingErr).
_NON_BLOCKING = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of"}
_NON_BLOCKING |= {"string_pattern_mismatch", "string_too_short", "too_short"}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class Problem:
    """One reason a manifest is invalid, printed as `FILE:LINE: field.path: message`."""

    file: str
    line: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.path}: {self.message}"


@dataclass
class Document:
    """One YAML document: its JSON value and the line of every node, by path."""

    data: Any
    start: int
    lines: dict[Path_, int] = field(default_factory=dict)

    def line(self, path: Path_) -> int:
        """Line of the deepest existing node on `path` (a defaulted field has no line of its own)."""
        for end in range(len(path), -1, -1):
            if path[:end] in self.lines:
                return self.lines[path[:end]]
        return self.start


class _Loader(yaml.SafeLoader):
    """YAML as kubectl reads it: timestamps stay strings, and 1e-6 is a float (sigs.k8s.io/yaml)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# kubectl's YAML reads 1e-6 as a number; PyYAML's YAML 1.1 floats need a dot and read a string.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _json_value(value: Any) -> Any:
    """A copy as the API server reads JSON: string keys, and 2.0 is an integer (it passes `type: integer`)."""
    if isinstance(value, dict):
        return {(str(k).lower() if isinstance(k, bool) else str(k)): _json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bytes):  # !!binary: JSON carries bytes as base64
        return base64.b64encode(value).decode()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)  # an explicit !!timestamp and the like: a string on the wire


def _index(node: yaml.Node, path: Path_, lines: dict[Path_, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            lines[(*path, str(key.value))] = key.start_mark.line + 1
            _index(value, (*path, str(key.value)), lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index(item, (*path, i), lines)


def load_documents(text: str, file: str) -> tuple[list[Document], list[Problem]]:
    """Parse multi-document YAML; a syntax error becomes one Problem with its line."""
    docs: list[Document] = []
    try:
        loader = _Loader(text)
    except yaml.YAMLError as err:  # a character YAML does not allow (ReaderError)
        line = text[: getattr(err, "position", 0)].count("\n") + 1
        return docs, [Problem(file, line, "<yaml>", f"invalid YAML: {str(err).splitlines()[0]}")]
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            doc = Document(_json_value(loader.construct_document(node)), node.start_mark.line + 1)
            _index(node, (), doc.lines)
            docs.append(doc)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        line = mark.line + 1 if mark else 1
        return docs, [Problem(file, line, "<yaml>", f"invalid YAML: {getattr(err, 'problem', None) or err}")]
    finally:
        loader.dispose()
    return [d for d in docs if d.data is not None], []


def dotted(path: Path_) -> str:
    """A path as the API server prints it: spec.trainer.tolerations[0].key, requests.nvidia.com/gpu."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "<root>"


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


def _schema_problems(obj: dict[str, Any]) -> tuple[list[tuple[Path_, str]], bool]:
    """Types, bounds, enums, required and unknown fields, by the models in strict (API server) mode."""
    try:
        job.GRPOJob.model_validate_json(json.dumps(obj), strict=True)
    except ValidationError as err:
        found: dict[Path_, tuple[str, list[str]]] = {}
        blocking = False
        for e in err.errors():
            path = _loc_path(e["loc"], obj)
            blocking |= e["type"] not in _NON_BLOCKING
            if e["type"] == "extra_forbidden":
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


def _cel_value(value: Any, schema: dict[str, Any]) -> Any:
    """The object as CEL sees it: typed by the schema (a `number` is a double even when written as 1)."""
    kind = schema.get("type")
    if isinstance(value, bool) or kind == "boolean":
        return celtypes.BoolType(value)
    if kind == "number" and isinstance(value, int | float):
        return celtypes.DoubleType(float(value))
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, str):
        return celtypes.StringType(value)
    if isinstance(value, list):
        return celtypes.ListType([_cel_value(v, schema.get("items", {})) for v in value])
    if isinstance(value, dict) and (
        "properties" in schema or isinstance(schema.get("additionalProperties"), dict)
    ):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties", {})
        return celtypes.MapType(
            {celtypes.StringType(k): _cel_value(v, props.get(k, extra)) for k, v in value.items()}
        )
    return celpy.json_to_cel(value)


_ENV = celpy.Environment()


@functools.cache
def _program(rule: str) -> Any:
    return _ENV.program(_ENV.compile(rule))


def evaluate_rule(rule: str, activation: dict[str, Any]) -> str | None:
    """None when the rule holds, "" when it is false (say its message), else the evaluation error."""
    try:
        result = _program(rule).evaluate(activation)
    except celpy.CELEvalError as err:
        return f"rule {rule!r} could not be evaluated: {err.args[0] if err.args else err}"
    if isinstance(result, celpy.CELEvalError):
        return f"rule {rule!r} could not be evaluated: {result.args[0] if result.args else result}"
    return None if bool(result) else ""


def _field_path(relative: str) -> Path_:
    return tuple(a or b for a, b in re.findall(r"\.([^.\[\]]+)|\['([^']*)'\]", relative))


def cel_problems(
    value: Any, schema: dict[str, Any], path: Path_ = (), old: Any = None, has_old: bool = False
) -> list[tuple[Path_, str]]:
    """Evaluate every CEL rule of `schema` on `value` and its descendants, as the API server does."""
    out: list[tuple[Path_, str]] = []
    rules = schema.get(CEL_KEY, [])
    if rules:
        shown = value if path else {**value, "metadata": _cel_metadata(value.get("metadata"))}
        activation = {"self": _cel_value(shown, schema)}
        if has_old:
            old_shown = old if path else {**old, "metadata": _cel_metadata(old.get("metadata"))}
            activation["oldSelf"] = _cel_value(old_shown, schema)
        for rule in rules:
            if re.search(r"\boldSelf\b", rule["rule"]) and not has_old:
                continue
            why = evaluate_rule(rule["rule"], activation)
            if why is not None:
                where = path + _field_path(rule.get("fieldPath", ""))
                out.append((where, why or rule.get("message") or f"failed rule: {rule['rule']}"))
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, sub_value in value.items():
            sub = props.get(key, extra)
            if isinstance(sub, dict) and (path or key != "metadata"):
                with_old = has_old and isinstance(old, dict) and key in old
                out += cel_problems(
                    sub_value, sub, (*path, key), old.get(key) if with_old else None, with_old
                )
    elif isinstance(value, list):
        keys = (
            schema.get("x-kubernetes-list-map-keys")
            if schema.get("x-kubernetes-list-type") == "map"
            else None
        )
        olds = (
            {tuple(o.get(k) for k in keys): o for o in old if isinstance(o, dict)} if keys and has_old else {}
        )
        for i, item in enumerate(value):
            ident = tuple(item.get(k) for k in keys) if keys and isinstance(item, dict) else None
            out += cel_problems(item, schema.get("items", {}), (*path, i), olds.get(ident), ident in olds)
    return out


def _cel_metadata(metadata: Any) -> dict[str, Any]:
    """CEL sees only metadata.name and metadata.generateName."""
    metadata = metadata if isinstance(metadata, dict) else {}
    return {k: metadata[k] for k in ("name", "generateName") if isinstance(metadata.get(k), str)}


def is_grpojob(obj: Any) -> bool:
    """Documents of other kinds (ConfigMaps, PVCs next to a job) are not ours to judge."""
    if not isinstance(obj, dict):
        return False
    api = obj.get("apiVersion")
    return obj.get("kind") == job.KIND or (isinstance(api, str) and api.startswith(f"{job.GROUP}/"))


def _identity(obj: dict[str, Any]) -> tuple[Any, Any]:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return meta.get("namespace"), meta.get("name")


@functools.cache
def _schema() -> dict[str, Any]:
    return crd.openapi_schema()


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


def check_object(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[tuple[Path_, str]]:
    """All problems of one GRPOJob object (an update of `old` when given), as (path, message)."""
    if obj.get("apiVersion") != job.API_VERSION or obj.get("kind") != job.KIND:
        got = f"{obj.get('apiVersion')}, Kind={obj.get('kind')}"
        return [((), f"no matches for {got}: want apiVersion {job.API_VERSION}, kind {job.KIND}")]
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not (name or meta.get("generateName")):
        return [(("metadata", "name"), "Required value: name or generateName is required")]
    out = metadata_problems(meta)
    schema = _schema()
    new = {k: _json_value(v) for k, v in obj.items() if k != "status"}
    if not name:  # the server validates the name it generates: generateName (cut to 58) + 5 characters
        new["metadata"]["name"] = f"{str(meta['generateName'])[:58]}x7b2q"
    apply_defaults(new, schema)
    problems, blocking = _schema_problems(new)
    out += problems
    if not blocking:
        if old is not None:
            old = {k: _json_value(v) for k, v in old.items() if k != "status"}
            apply_defaults(old, schema)
        out += cel_problems(new, schema, (), old, old is not None)
    return out


def validate_text(
    text: str, file: str = "<stdin>", old_text: str | None = None, old_file: str = "<old>"
) -> list[Problem]:
    """Every problem of every GRPOJob in `text`; with `old_text`, same-named jobs are checked as updates."""
    docs, problems = load_documents(text, file)
    olds: dict[tuple[Any, Any], dict[str, Any]] = {}
    if old_text is not None:
        old_docs, old_problems = load_documents(old_text, old_file)
        problems += old_problems
        olds = {_identity(d.data): d.data for d in old_docs if is_grpojob(d.data)}
    jobs = [d for d in docs if is_grpojob(d.data)]
    for doc in jobs:
        found = [
            Problem(file, doc.line(path), dotted(path), message)
            for path, message in check_object(doc.data, olds.get(_identity(doc.data)))
        ]
        problems += sorted(found, key=lambda p: p.line)
    if not jobs and not problems:
        problems.append(Problem(file, 1, "<file>", f"no {job.KIND} ({job.API_VERSION}) document found"))
    return problems


def validate_file(path: str | Path, old: str | Path | None = None) -> list[Problem]:
    """validate_text on a file (and its old version); `-` reads standard input."""
    text = sys.stdin.read() if str(path) == "-" else Path(path).read_text(encoding="utf-8")
    old_text = Path(old).read_text(encoding="utf-8") if old is not None else None
    return validate_text(text, str(path), old_text, str(old))
