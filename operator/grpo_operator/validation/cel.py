"""The CRD's `x-kubernetes-validations` rules evaluated with cel-python, as the API server does.

Used by `grpo_operator.validation.check` on the defaulted object; the rules are read from the
generated CRD schema, never re-implemented. Values are typed by the schema (a `number` is a
double even when written as 1), metadata is cut to what CEL sees, and transition rules
(`oldSelf`) run only when an old object is given, matched by list-map keys.
"""

import functools
import re
from typing import Any

import celpy
from celpy import celtypes

from grpo_operator.api.base import CEL_KEY
from grpo_operator.validation.yaml_docs import Path_


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
