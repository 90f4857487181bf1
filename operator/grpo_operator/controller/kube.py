"""A small typed shell over the Kubernetes REST API for the controller (sync, thread-safe).

Called by `controller.reconcile` from kopf's executor threads. It speaks plain dicts (the
renderer's output) for any kind the operator owns, does server-side apply with one field
manager, and counts every write in `controller.metrics` so tests and the scale benchmark
can prove that a reconcile which changes nothing writes nothing.
"""

import json
import uuid
from typing import Any

from kubernetes import client

from grpo_operator.api.job import API_VERSION, PLURAL
from grpo_operator.controller import metrics
from grpo_operator.render import names

ApiException = client.ApiException

PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "ServiceAccount": "serviceaccounts",
    "Service": "services",
    "Pod": "pods",
    "Event": "events",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "StatefulSet": "statefulsets",
    "LeaderWorkerSet": "leaderworkersets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "PodGroup": "podgroups",
    "Workload": "workloads",
    "GRPOJob": PLURAL,
}
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE"}
# (connect, read) seconds of every call: a black-holed connection fails the pass instead of
# hanging a worker (a pass still running after metrics.PassWatch.stuck_after fails /healthz).
REQUEST_TIMEOUT = (10.0, 60.0)


def path(api_version: str, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    out = f"{base}/namespaces/{namespace}/{PLURALS[kind]}"
    if name:
        out += f"/{name}"
    if sub:
        out += f"/{sub}"
    return out


class Kube:
    """REST calls with JSON in and out; ApiException on any non-2xx answer."""

    def __init__(self, api: client.ApiClient, field_manager: str = names.MANAGER) -> None:
        self.api = api
        self.field_manager = field_manager

    def request(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        kind: str = "",
    ) -> dict | None:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        # The client serialises dicts for JSON content types itself; apply-patch YAML goes as text.
        data = json.dumps(body) if body is not None and not content_type.endswith("json") else body
        method_, full, headers, _, _ = self.api.param_serialize(
            method, url, query_params=query or [], header_params=headers, auth_settings=["BearerToken"]
        )
        if method in WRITE_VERBS:
            metrics.API_WRITES.labels(verb=method.lower(), kind=kind or "other").inc()
        resp = self.api.call_api(
            method_, full, header_params=headers, body=data, _request_timeout=REQUEST_TIMEOUT
        )
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException(http_resp=resp)
        return json.loads(resp.data) if resp.data else None

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self.request("GET", path(api_version, kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def apply(self, obj: dict) -> dict | None:
        """Server-side apply as the operator's field manager (force: we own these fields)."""
        meta = obj["metadata"]
        url = path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", self.field_manager), ("force", "true")]
        return self.request(
            "PATCH", url, body=obj, query=query, content_type="application/apply-patch+yaml", kind=obj["kind"]
        )

    def serves(self, api_version: str) -> bool:
        """Whether the API server serves this group/version (discovery; a CRD not installed: no)."""
        try:
            self.request("GET", f"/apis/{api_version}")
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    def create(self, obj: dict) -> bool:
        """Create unless it exists; True when created."""
        meta = obj["metadata"]
        try:
            self.request(
                "POST", path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj, kind=obj["kind"]
            )
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    def list_pods(self, namespace: str, selector: str) -> list[dict]:
        out = self.request("GET", path("v1", "Pod", namespace), query=[("labelSelector", selector)])
        return (out or {}).get("items", [])

    def list_nodes(self, selector: str) -> list[dict]:
        out = self.request("GET", "/api/v1/nodes", query=[("labelSelector", selector)])
        return (out or {}).get("items", [])

    def delete_pod(self, namespace: str, name: str, uid: str | None = None, force: bool = False) -> None:
        """Delete one pod; with `uid`, only that incarnation (never its replacement); `force`
        skips the grace period, for pods whose Node object is gone and cannot confirm."""
        body: dict = {"kind": "DeleteOptions", "apiVersion": "v1"}
        if force:
            body["gracePeriodSeconds"] = 0
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", path("v1", "Pod", namespace, name), body=body, kind="Pod")
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def get_cluster_scoped(self, api_version: str, plural: str, name: str) -> dict | None:
        try:
            return self.request("GET", f"/apis/{api_version}/{plural}/{name}")
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self.request("DELETE", path(api_version, kind, namespace, name), body=body, kind=kind)
        except ApiException as e:
            if e.status != 404:
                raise

    def patch_status_of(self, obj: dict, status: dict) -> None:
        """Merge-patch another controller's object's status, only if it has not changed since
        read (resourceVersion): its lists (conditions) are replaced whole."""
        meta = obj["metadata"]
        url = path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"], "status")
        body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status}
        self.request("PATCH", url, body=body, content_type="application/merge-patch+json", kind=obj["kind"])

    def delete_job(self, namespace: str, name: str) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            self.request("DELETE", path(API_VERSION, "GRPOJob", namespace, name), body=body, kind="GRPOJob")
        except ApiException as e:
            if e.status != 404:
                raise

    def scale(self, api_version: str, kind: str, namespace: str, name: str, replicas: int) -> None:
        """Set a StatefulSet's or LeaderWorkerSet's replicas with a merge patch (the RBAC the chart
        grants; the next apply forces them); one that is not there (or an API not served) is a no-op."""
        url = path(api_version, kind, namespace, name)
        try:
            body = {"spec": {"replicas": replicas}}
            self.request("PATCH", url, body=body, content_type="application/merge-patch+json", kind=kind)
        except ApiException as e:
            if e.status != 404:
                raise

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        url = path(API_VERSION, "GRPOJob", namespace, name, "status")
        self.request(
            "PATCH", url, body={"status": status}, content_type="application/merge-patch+json", kind="GRPOJob"
        )

    def event(self, job: dict, event_type: str, reason: str, message: str, now: str) -> None:
        """A core/v1 Event on the GRPOJob, shown by `kubectl describe grpo`."""
        meta = job["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": "GRPOJob",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1000],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": names.MANAGER},
            "reportingComponent": names.MANAGER,
        }
        self.request("POST", path("v1", "Event", meta["namespace"]), body=body, kind="Event")
