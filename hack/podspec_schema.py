"""Resolve core/v1 PodSpec from the Kubernetes OpenAPI v3 document into one inline structural schema.

Run by hack/podspec-schema.sh (which finds the document in the k8s.io/kubernetes Go module of
hack/versions.sh's K8S_VERSION); its output, operator/grpo_operator/api/podspec.schema.json, is
checked in, so building the CRD and the tests need neither Go nor the network. The GRPOJob
models embed that schema as `spec.{trainer,rollout}.template.spec`, the way JobSet's and
Kubeflow Trainer's CRDs embed PodSpec (there via controller-gen, here from the same OpenAPI).

What the resolver does to the OpenAPI:
- `$ref` and `allOf: [$ref]` are inlined; a type met again inside itself (none in PodSpec
  today) becomes an object that keeps unknown fields, so recursion cannot loop.
- IntOrString and Quantity (`oneOf` integer/number/string) become `x-kubernetes-int-or-string`,
  a Quantity with the pattern controller-gen gives it.
- Descriptions, patch-strategy markers and union hints are dropped (size; the CRD cannot
  carry them); zero-value defaults ("", 0, false, {}) are dropped because openapi-gen writes
  them for every non-pointer field, not as API defaults; real defaults (`protocol: TCP`) stay.
- Every integer gets its format's range as minimum/maximum (int64: what a float64 holds
  exactly, the form the API server checks bounds in), every list and map a size bound.
- ObjectMeta (only inside ephemeral volume claim templates) keeps what a template may set.

And, as a template for a StatefulSet's pods that a user only partly overrides (OVERRIDES):
PodSpec's `containers` is not required, fields a StatefulSet refuses are left out or narrowed,
init containers need an image (the operator renders none, so each is added whole), and port
numbers stay within 1-65535, which the API server would otherwise only check on the pods.
"""

import argparse
import json
import sys
from typing import Any

ROOT_TYPE = "io.k8s.api.core.v1.PodSpec"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
    r"|(\.[0-9]+))))?$"
)
# int64 bounded at 2^53 - 1: the API server holds bounds as float64 and refuses one past int64.
INT_RANGE = {"int32": 2**31 - 1, "int64": 2**53 - 1}
MAX_ITEMS = 256  # lists and maps of an override; bounded so the API server's CEL cost estimates stay small
PORTS = {"containerPort": 1, "hostPort": 0}  # hostPort 0: none
MAX_NAME = 63  # container names are DNS labels; bounded so CEL rules over containers stay cheap
KEPT = (
    "type", "format", "enum", "default", "minimum", "maximum", "minLength", "maxLength", "pattern",
    "minItems", "maxItems", "properties", "required", "additionalProperties", "items",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type",
)  # fmt: skip
ZERO_DEFAULTS = ("", 0, False, {}, [])
META_KEPT = ("name", "namespace", "labels", "annotations", "finalizers")


class Resolver:
    """Inline the `$ref`s under one schema of an OpenAPI v3 document's components."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.types = document["components"]["schemas"]

    def resolve(self, name: str, stack: tuple[str, ...] = ()) -> dict[str, Any]:
        if name in (INT_OR_STRING, QUANTITY):
            out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
            return {**out, "pattern": QUANTITY_PATTERN} if name == QUANTITY else out
        if name in stack:  # recursion cut-off: the type inside itself keeps its fields unchecked
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        node = self.node(self.types[name], (*stack, name))
        if name == OBJECT_META:
            node["properties"] = {k: v for k, v in node["properties"].items() if k in META_KEPT}
        return node

    def node(self, raw: dict[str, Any], stack: tuple[str, ...]) -> dict[str, Any]:
        refs = [raw["$ref"]] if "$ref" in raw else [m["$ref"] for m in raw.get("allOf", []) if "$ref" in m]
        out: dict[str, Any] = {}
        if refs:
            (ref,) = refs
            out = self.resolve(ref.rsplit("/", 1)[-1], stack)
        for key, value in raw.items():
            if key not in KEPT:
                continue
            if key == "properties":
                value = {k: self.node(v, stack) for k, v in value.items()}
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                value = self.node(value, stack)
            out[key] = value
        if out.get("type") == "integer":
            limit = INT_RANGE.get(out.get("format", "int64"), INT_RANGE["int64"])
            out.setdefault("minimum", -limit - (out.get("format") == "int32"))
            out.setdefault("maximum", limit)
        if out.get("type") == "array":
            out.setdefault("maxItems", MAX_ITEMS)
        if out.get("type") == "object" and isinstance(out.get("additionalProperties"), dict):
            out.setdefault("maxProperties", MAX_ITEMS)
        return out


def without_zero_defaults(node: dict[str, Any], keep: bool = False) -> dict[str, Any]:
    """Drop openapi-gen's zero-value defaults, except on optional list-map keys (the API server wants
    every key required or defaulted; a default on a required key would make it never missing)."""
    out = dict(node)
    if not keep and "default" in out and out["default"] in ZERO_DEFAULTS:
        del out["default"]
    if "properties" in node:
        out["properties"] = {k: without_zero_defaults(v) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = without_zero_defaults(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        out["items"] = items = without_zero_defaults(node["items"])
        for key in set(node.get("x-kubernetes-list-map-keys", ())) - set(items.get("required", ())):
            items["properties"][key] = without_zero_defaults(node["items"]["properties"][key], keep=True)
    return out


def port_bounds(node: dict[str, Any]) -> None:
    """Port numbers get their real range (Go validation, not the OpenAPI, says 1-65535)."""
    for name, sub in node.get("properties", {}).items():
        if name in PORTS and sub.get("type") == "integer":
            sub["minimum"], sub["maximum"] = PORTS[name], 65535
        port_bounds(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            port_bounds(node[key])


def overrides(spec: dict[str, Any]) -> dict[str, Any]:
    """Fit PodSpec to a partial template for a StatefulSet's pods (the module docstring says why)."""
    props = spec["properties"]
    spec.pop("required", None)  # an override names only what it adds; the operator renders containers
    del props["ephemeralContainers"]  # refused in pod templates ("cannot be set on create")
    del props["activeDeadlineSeconds"]  # a StatefulSet refuses it ("not supported")
    props["restartPolicy"]["enum"] = ["Always"]  # the only one a StatefulSet accepts
    for key in ("containers", "initContainers"):
        props[key]["items"]["properties"]["name"]["maxLength"] = MAX_NAME
    port_bounds(spec)
    init = props["initContainers"]["items"]
    init["required"] = sorted({*init.get("required", []), "image"})
    return spec


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def pod_spec_schema(document: dict[str, Any]) -> dict[str, Any]:
    """The inline structural schema of a PodSpec override, from the Kubernetes OpenAPI v3 document."""
    return _sorted(overrides(without_zero_defaults(Resolver(document).resolve(ROOT_TYPE))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("openapi", help="api/openapi-spec/v3/api__v1_openapi.json of k8s.io/kubernetes")
    parser.add_argument(
        "--source", required=True, help="what the document is, e.g. k8s.io/kubernetes@v1.36.3"
    )
    args = parser.parse_args(argv)
    with open(args.openapi, encoding="utf-8") as f:
        schema = pod_spec_schema(json.load(f))
    data = {"source": f"{args.source} api/openapi-spec/v3/api__v1_openapi.json {ROOT_TYPE}", "schema": schema}
    json.dump(data, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
