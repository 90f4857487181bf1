"""A job's rendered children onto the cluster: server-side apply of what changed, nothing more.

Called by `controller.reconcile` once per pass with what `render` produced. Each child carries a
hash of its desired state; a child whose hash the operator last applied is skipped, and every
`verify_seconds` the live objects are read back, so a child edited or deleted by hand is
repaired without diffing on every pass (200 jobs: 0 writes/min in the steady state). The job's
token Secret is created here once: its value is random, so it is never re-rendered.

Nothing the job does not own is ever written: before a child is applied (and on every verify
read) the live object must carry this job's controller reference, else the pass stops with
`ChildConflict` before applying anything, and the foreign object stays as it is.
"""

import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field

from grpo_operator import render
from grpo_operator.api.job import KIND
from grpo_operator.api.status import Reason
from grpo_operator.controller.kube import Kube
from grpo_operator.render import names

HASH_ANNOTATION = "grpo.dev/applied-hash"


@dataclass
class AppliedMemory:
    """What was applied for one job (lost on restart, which only costs reads)."""

    applied: dict[str, str] = field(default_factory=dict)  # child key → hash
    verified_at: float = float("-inf")
    token_uid: str = ""  # the job incarnation whose token Secret is known to exist
    served: set[str] = field(default_factory=set)  # third-party API versions seen served


class ChildConflict(RuntimeError):
    """A child's name is taken by an object this job does not control: nothing was applied."""

    reason = "ChildConflict"


class ApiNotServed(RuntimeError):
    """A child's kind is not served by this cluster (its CRD is not installed): nothing was applied."""

    reason = Reason.API_NOT_SERVED


# Kinds of other projects a job may render, and what makes a job need them
THIRD_PARTY = {
    names.LWS_API_VERSION: "rollout.nodesPerServer above 1 runs each rollout server as a LeaderWorkerSet "
    "group: install the LeaderWorkerSet controller (kubernetes-sigs/lws; docs/install-eks.md), or set "
    "rollout.nodesPerServer 1",
}


def owned_by(live: dict, uid: str) -> bool:
    """Whether `live` carries a controller owner reference to the job with this uid."""
    refs = live.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("controller") is True and ref.get("uid") == uid for ref in refs)


def owner_of(live: dict) -> str:
    """Who controls `live`, in words, for the conflict message."""
    refs = live.get("metadata", {}).get("ownerReferences") or []
    controller = [r for r in refs if r.get("controller") is True]
    shown = controller or refs
    if not shown:
        return "none"
    text = ", ".join(f"{r.get('kind')} {r.get('name')} uid {r.get('uid')}" for r in shown)
    return text if controller else f"none (only non-controller references: {text})"


def conflict(child: dict, live: dict, job: str) -> ChildConflict:
    what = f"{child['kind']} {child['metadata']['name']}"
    refs = live.get("metadata", {}).get("ownerReferences") or []
    if any(r.get("controller") is True and r.get("kind") == KIND and r.get("name") == job for r in refs):
        # A job deleted and recreated under the same name: its children go with garbage collection.
        return ChildConflict(
            f"{what} still belongs to an earlier GRPOJob named {job} (owner: {owner_of(live)}); "
            "waiting for garbage collection to delete it"
        )
    return ChildConflict(
        f"{what} exists and is not owned by this GRPOJob (owner: {owner_of(live)}); "
        "rename the job or delete that object"
    )


def child_key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def with_hash(obj: dict) -> tuple[dict, str]:
    """The object annotated with a hash of its desired state, compared instead of diffing."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    annotated = {**obj, "metadata": {**obj["metadata"]}}
    annotated["metadata"]["annotations"] = {**obj["metadata"].get("annotations", {}), HASH_ANNOTATION: digest}
    return annotated, digest


class ChildApplier:
    def __init__(self, kube: Kube, *, verify_seconds: float) -> None:
        self.kube = kube
        self.verify_seconds = verify_seconds

    def apply(self, rendered: render.Rendered, memory: AppliedMemory, body: dict) -> None:
        """Server-side apply each child whose desired hash differs from what the cluster has.

        Every child about to be applied (all of them on a verify pass) is read first; a live
        object without this job's controller reference raises ChildConflict before anything
        is applied, so a name clash never leaves a half-made gang."""
        uid = body["metadata"]["uid"]
        verify = time.monotonic() - memory.verified_at > self.verify_seconds
        todo: list[tuple[str, dict, str]] = []
        self._check_apis(rendered, memory)
        for child in rendered.children:
            obj, digest = with_hash(child)
            key = child_key(child)
            if not verify and memory.applied.get(key) == digest:
                continue
            meta = child["metadata"]
            live = self.kube.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
            if live is not None and not owned_by(live, uid):
                raise conflict(child, live, body["metadata"]["name"])
            if live and (live["metadata"].get("annotations") or {}).get(HASH_ANNOTATION) == digest:
                memory.applied[key] = digest
                continue
            todo.append((key, obj, digest))
        for key, obj, digest in todo:
            self.kube.apply(obj)
            memory.applied[key] = digest
        if verify:
            memory.verified_at = time.monotonic()
        if memory.token_uid != uid:
            self._ensure_token(body["metadata"])
            memory.token_uid = uid

    def _check_apis(self, rendered: render.Rendered, memory: AppliedMemory) -> None:
        """Every third-party kind the job renders is served here, before anything is applied: a
        missing CRD is said on the job (ApiNotServed, naming the field that needs it), and the pass is
        retried with backoff until it is installed. Asked once per job until it is there."""
        for api_version in sorted({c["apiVersion"] for c in rendered.children} & THIRD_PARTY.keys()):
            if api_version in memory.served:
                continue
            if not self.kube.serves(api_version):
                kinds = sorted({c["kind"] for c in rendered.children if c["apiVersion"] == api_version})
                why = THIRD_PARTY[api_version]
                raise ApiNotServed(f"{', '.join(kinds)} ({api_version}) is not served by this cluster: {why}")
            memory.served.add(api_version)

    def _ensure_token(self, meta: dict) -> None:
        """Create the job's token Secret unless it is there: its name carries the job's uid, so
        an existing one is this job's (created by an earlier pass), and the operator needs no
        `get` on Secrets (a 409 AlreadyExists is the answer)."""
        token = secrets.token_urlsafe(32)
        self.kube.create(
            render.token_secret(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"], token=token)
        )
