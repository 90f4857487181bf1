"""The kopf peering CRDs that leader election among operator replicas needs.

Called by `grpo-operator operator --peering NAME` at start: with several replicas, kopf
keeps the one with the highest priority active and pauses the others; that needs the
KopfPeering (namespaced) and ClusterKopfPeering resources, which we create if missing.
"""

import logging
import time
from collections.abc import Callable

from kubernetes import client

log = logging.getLogger("grpo_operator.peering")
_SCHEMA = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def crd(kind: str, scope: str) -> dict:
    plural = kind.lower() + "s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.kopf.dev"},
        "spec": {
            "group": "kopf.dev",
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": _SCHEMA},
                }
            ],
        },
    }


def ensure(api: client.ApiClient, *, clusterwide: bool, namespaces: list[str], name: str) -> None:
    """Create the peering CRDs and the peering object for `name` when they are missing.

    A 403 is not fatal: the Helm chart installs the CRDs and an operator without the right
    to create them should still start."""
    ext = client.ApiextensionsV1Api(api)
    custom = client.CustomObjectsApi(api)
    for kind, scope in (("KopfPeering", "Namespaced"), ("ClusterKopfPeering", "Cluster")):
        _tolerate(
            lambda kind=kind, scope=scope: ext.create_custom_resource_definition(crd(kind, scope)), kind
        )
    _wait_established(ext, ["kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"])
    peer = {"metadata": {"name": name}, "apiVersion": "kopf.dev/v1"}
    if clusterwide:
        body = peer | {"kind": "ClusterKopfPeering"}
        _tolerate(
            lambda: custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", body), name
        )
    for ns in namespaces:
        body = peer | {"kind": "KopfPeering"}
        _tolerate(
            lambda ns=ns, body=body: custom.create_namespaced_custom_object(
                "kopf.dev", "v1", ns, "kopfpeerings", body
            ),
            f"{ns}/{name}",
        )


def _tolerate(create: Callable[[], object], what: str) -> None:
    try:
        create()
    except client.ApiException as e:
        if e.status == 403:
            log.warning("not allowed to create peering %s; assuming it is installed", what)
        elif e.status != 409:
            raise


def _wait_established(ext: client.ApiextensionsV1Api, names: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for n in names:
        while time.monotonic() < deadline:
            try:
                conds = ext.read_custom_resource_definition(n).status.conditions or []
            except client.ApiException:
                return  # cannot read CRDs: kopf will say clearly if peering is missing
            if any(c.type == "Established" and c.status == "True" for c in conds):
                break
            time.sleep(0.2)
