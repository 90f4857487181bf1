"""The core/v1 PodSpec schema that `template.spec` of each role is validated against.

The schema is data, not code: podspec.schema.json beside this module is generated from the
Kubernetes OpenAPI v3 document by hack/podspec-schema.sh (`make podspec-schema`) and checked
in. `PodSpecOverride` gives it to the CRD generator as the JSON Schema of `template.spec`
(the model keeps a plain dict: the renderer merges dicts); `grpo_operator.validation` checks
manifests against the same schema, read back from the generated CRD.
"""

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import WithJsonSchema

SCHEMA_FILE = Path(__file__).with_name("podspec.schema.json")
_DATA = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
SOURCE: str = _DATA["source"]  # k8s.io/kubernetes@<version> and the document it was resolved from
# Container names the operator renders (render.names.ROLE_*): an override entry with that name
# changes the rendered container, any other entry is a sidecar and needs an image of its own.
MAIN_CONTAINERS = {"trainer": "trainer", "rollout": "rollout", "reward": "reward"}


def schema() -> dict[str, Any]:
    """A fresh copy of the resolved PodSpec schema (callers may add to it)."""
    return json.loads(json.dumps(_DATA["schema"]))


PodSpecOverride = Annotated[dict[str, Any], WithJsonSchema(schema())]


def sidecars_need_images(role: str) -> tuple[str, str, str]:
    """CEL rule on a role: every container of its template other than the rendered one has an image."""
    main = MAIN_CONTAINERS[role]
    rule = (
        "!has(self.template) || !has(self.template.spec) || !has(self.template.spec.containers) || "
        f"self.template.spec.containers.all(c, has(c.image) || (has(c.name) && c.name == '{main}'))"
    )
    return rule, f"a container other than '{main}' needs an image", ".template.spec.containers"
