"""hack/podspec_schema.py: the Kubernetes OpenAPI resolved into the PodSpec schema the CRD embeds."""

import json
import os
import re
from pathlib import Path

import pytest
from grpo_operator.api import podspec

from hack import podspec_schema as gen

ROOT = Path(__file__).resolve().parents[2]
REF = "#/components/schemas/"


def document(**types: dict) -> dict:
    return {"components": {"schemas": types}}


def test_refs_are_inlined_and_zero_defaults_dropped() -> None:
    doc = document(
        Outer={
            "type": "object",
            "description": "dropped",
            "properties": {
                "inner": {"allOf": [{"$ref": REF + "Inner"}], "default": {}},
                "size": {"$ref": REF + gen.QUANTITY},
                "port": {"allOf": [{"$ref": REF + gen.INT_OR_STRING}]},
                "count": {"type": "integer", "format": "int32", "default": 0},
                "items": {
                    "type": "array",
                    "items": {"allOf": [{"$ref": REF + "Item"}], "default": {}},
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-list-map-keys": ["name"],
                    "x-kubernetes-patch-merge-key": "name",
                },
            },
        },
        Inner={"type": "object", "properties": {"mode": {"type": "string", "default": "TCP"}}},
        Item={"type": "object", "properties": {"name": {"type": "string", "default": ""}}},
    )
    out = gen.without_zero_defaults(gen.Resolver(doc).resolve("Outer"))
    props = out["properties"]
    assert "description" not in out and "default" not in props["inner"]
    assert props["inner"]["properties"]["mode"] == {"type": "string", "default": "TCP"}
    assert props["size"] == {"x-kubernetes-int-or-string": True, "pattern": gen.QUANTITY_PATTERN}
    assert props["port"] == {"x-kubernetes-int-or-string": True}
    assert props["count"] == {"type": "integer", "format": "int32", "minimum": -(2**31), "maximum": 2**31 - 1}
    assert (
        props["items"]["maxItems"] == gen.MAX_ITEMS and "x-kubernetes-patch-merge-key" not in props["items"]
    )
    # an optional list-map key keeps its default: the API server wants keys required or defaulted
    assert props["items"]["items"]["properties"]["name"] == {"type": "string", "default": ""}


def test_a_type_inside_itself_is_cut_off() -> None:
    doc = document(Node={"type": "object", "properties": {"child": {"allOf": [{"$ref": REF + "Node"}]}}})
    child = gen.Resolver(doc).resolve("Node")["properties"]["child"]
    assert child == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def test_checked_in_schema_fits_a_partial_statefulset_template() -> None:
    schema = podspec.schema()
    props = schema["properties"]
    assert "required" not in schema and props["restartPolicy"]["enum"] == ["Always"]
    assert "ephemeralContainers" not in props and "activeDeadlineSeconds" not in props
    container = props["containers"]["items"]
    assert container["required"] == ["name"] and container["properties"]["name"]["maxLength"] == 63
    assert props["initContainers"]["items"]["required"] == ["image", "name"]
    port = container["properties"]["ports"]["items"]["properties"]["containerPort"]
    assert (port["minimum"], port["maximum"]) == (1, 65535)
    assert "description" not in json.dumps(schema)


def _openapi_document() -> Path | None:
    """The document in the local Go module cache, if `make control-plane` has downloaded it."""
    version = re.search(r"K8S_VERSION:-(v[0-9.]+)", (ROOT / "hack" / "versions.sh").read_text())
    cache = Path(os.environ.get("GOMODCACHE") or Path.home() / "go" / "pkg" / "mod")
    path = cache / f"k8s.io/kubernetes@{version[1]}/api/openapi-spec/v3/api__v1_openapi.json"
    return path if version and path.is_file() else None


@pytest.mark.skipif(_openapi_document() is None, reason="k8s.io/kubernetes is not in the Go module cache")
def test_checked_in_schema_is_the_generator_output() -> None:
    document = json.loads(_openapi_document().read_text())  # type: ignore[union-attr]
    assert gen.pod_spec_schema(document) == podspec.schema(), "run `make podspec-schema` and `make crd`"
