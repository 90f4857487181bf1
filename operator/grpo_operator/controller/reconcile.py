"""One reconcile pass of one GRPOJob: read, render, observe, decide, then write only diffs.

Called by the per-job kopf daemon in `controller.handlers` (in an executor thread). Order
matters for restart safety: a gang restart is recorded in status (restarts = attempt)
before any pod is deleted, and stale-attempt trainer pods are deleted on every pass, so an
operator killed at any point converges on the next pass without duplicates.
"""

import dataclasses
import hashlib
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError

from grpo_operator import render
from grpo_operator.api.job import API_VERSION, KIND, GRPOJob
from grpo_operator.api.status import TERMINAL_PHASES, GRPOJobStatus, Phase
from grpo_operator.controller import admission, metrics, observe, placement, status
from grpo_operator.controller.kube import Kube
from grpo_operator.instance_types import INSTANCE_TYPE_LABEL, InstanceTable
from grpo_operator.render import kueue, names
from grpo_operator.render.pods import ZONE_KEY

HASH_ANNOTATION = "grpo.dev/applied-hash"
OPERATOR_STATUS_FIELDS = (
    "phase",
    "conditions",
    "observedGeneration",
    "restarts",
    "trainer",
    "rollout",
    "startTime",
    "completionTime",
    "message",
)
log = logging.getLogger("grpo_operator.reconcile")


@dataclass
class JobMemory:
    """What one job's worker remembers between passes (lost on restart, which only costs reads)."""

    applied: dict[str, str] = field(default_factory=dict)
    verified_at: float = float("-inf")
    token_ok: bool = False
    warned_generation: int | None = None
    zone: tuple[int, str | None] | None = None  # (attempt, zone) of the trainer gang
    verdicts: deque = field(default_factory=deque)
    kueue_warned: bool = False  # the queue label was seen without --kueue (one Event)
    # ResourceFlavors of the current Kueue admission, read once per admission, not every pass.
    flavors: dict[str, kueue.FlavorPlacement] = field(default_factory=dict)


def child_key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def with_hash(obj: dict) -> tuple[dict, str]:
    """The object annotated with a hash of its desired state, compared instead of diffing."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    annotated = {**obj, "metadata": {**obj["metadata"]}}
    annotated["metadata"]["annotations"] = {**obj["metadata"].get("annotations", {}), HASH_ANNOTATION: digest}
    return annotated, digest


class Reconciler:
    def __init__(
        self, kube: Kube, table: InstanceTable, *, verify_seconds: float = 300.0, kueue: bool = False
    ) -> None:
        self.kube = kube
        self.table = table
        self.verify_seconds = verify_seconds
        self.kueue = kueue  # queue labelled jobs through Kueue Workloads
        self.lost_nodes: set[str] = set()  # deleted or not Ready: their trainer pods fail the gang
        self.gone_nodes: set[str] = set()  # deleted: their pods are force-deleted

    def reconcile(self, namespace: str, name: str, memory: JobMemory) -> float | None:
        """One pass; returns seconds until a pass is due anyway (deadline, TTL), or None."""
        started = time.perf_counter()
        pending = [memory.verdicts.popleft() for _ in range(len(memory.verdicts))]
        try:
            delay = self._pass(namespace, name, memory, pending)
        except Exception:
            memory.verdicts.extendleft(reversed(pending))
            metrics.RECONCILE_ERRORS.inc()
            metrics.RECONCILES.labels(result="error").inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        metrics.RECONCILES.labels(result="ok").inc()
        return delay

    def _pass(self, namespace: str, name: str, memory: JobMemory, pending: list) -> float | None:
        body = self.kube.get(API_VERSION, KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        meta = body["metadata"]
        generation = meta.get("generation", 1)
        now = datetime.now(UTC)
        old = _old_status(body)
        job, error, rendered = self._render(body, memory, attempt=old.restarts)
        born = meta.get("creationTimestamp", "")  # RFC 3339 in UTC: compares as text
        pods = self.kube.list_pods(namespace, names.label_selector(name))
        pods = [p for p in pods if p["metadata"].get("creationTimestamp", "") >= born]  # not a namesake's
        obs = observe.summarize(pods, attempt=old.restarts, lost_nodes=frozenset(self.lost_nodes))
        obs.verdicts += [v for v in pending if v.created >= born]
        queue, workload, priority = self._queue(body, job if error is None else None, memory, now)
        decision = status.decide(
            spec=job.spec if job else None,
            generation=generation,
            old=old,
            obs=obs,
            now=now,
            render_error=error,
            queue=queue,
        )
        if decision.gang_restart:
            # Record the new attempt first: a crash after this line still restarts the gang.
            self._write_status(body, decision.status)
            metrics.GANG_RESTARTS.inc()
        if job is not None and error is None:
            admitted = queue is not None and queue.runs and decision.running
            if not admitted:
                memory.flavors = {}  # a later admission may assign other flavors
            if not decision.running or decision.status.restarts != old.restarts or admitted:
                _, _, rendered = self._render(
                    body,
                    memory,
                    attempt=decision.status.restarts,
                    running=decision.running,
                    admitted=queue if admitted else None,
                )
            self._apply_children(rendered, memory, body)
            self._delete_stale(
                namespace, pods, attempt=decision.status.restarts, obs=obs, running=decision.running
            )
            if queue is not None:
                self._sync_workload(body, job, rendered, queue, workload, priority, decision, pods, now)
        elif any(not p["metadata"].get("deletionTimestamp") for p in pods):
            # The spec no longer renders (say an edit named an unknown instance type): a
            # Failed job must not keep GPUs, so stop what the last good spec started.
            for role in (names.ROLE_TRAINER, names.ROLE_ROLLOUT):
                self.kube.scale_statefulset(namespace, names.statefulset(name, role), 0)
        if not decision.gang_restart:
            self._write_status(body, decision.status)
        self._emit(body, decision.events, memory, rendered, generation, now)
        metrics.set_phase(f"{namespace}/{name}", decision.status.phase)
        if decision.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished passed", namespace, name)
            self.kube.delete_job(namespace, name)
        return decision.requeue_after

    def _render(
        self,
        body: dict,
        memory: JobMemory,
        *,
        attempt: int,
        running: bool = True,
        admitted: admission.Admission | None = None,
    ):
        """(job, error, rendered): a bad object becomes an error message, never an exception.
        `admitted`: Kueue's admission of a queued job (its flavors and admitted counts)."""
        meta = body["metadata"]
        try:
            job = GRPOJob.model_validate({"metadata": {}, "spec": body.get("spec") or {}})
            flavors, rollout_cap = None, None
            if admitted is not None:
                if not memory.flavors:
                    memory.flavors = {r: self._flavor(admitted.flavors.get(r, [])) for r in kueue.ROLES}
                flavors = memory.flavors
                rollout_cap = min(job.spec.rollout.replicas, admitted.counts.get(names.ROLE_ROLLOUT, 1 << 30))
            # A flavor that names a zone is where Kueue reserved the quota: it wins over our choice.
            zoned = flavors is not None and ZONE_KEY in flavors[names.ROLE_TRAINER].node_labels
            zone = self._zone(job, meta, memory, attempt) if running and not zoned else None
            out = render.render(
                job,
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta["uid"],
                generation=meta.get("generation", 1),
                attempt=attempt,
                running=running,
                zone=zone,
                instance_types=self.table,
                flavors=flavors,
                rollout_replicas=rollout_cap,
            )
            if rollout_cap is not None and rollout_cap < job.spec.rollout.replicas:
                out.warnings.append(
                    f"rollout.replicas {job.spec.rollout.replicas} is more than the {rollout_cap} Kueue "
                    "admitted: the rest start when the job is admitted again (suspend and resume it)"
                )
            return job, None, out
        except ValidationError as e:
            return None, f"invalid spec: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}", None
        except render.RenderError as e:
            return None, str(e), None

    def _flavor(self, flavor_names: list[str]) -> kueue.FlavorPlacement:
        flavors = [
            self.kube.get_cluster_scoped(kueue.API_VERSION, "resourceflavors", n) for n in flavor_names
        ]
        return kueue.flavor_placement([f for f in flavors if f is not None])

    def _queue(
        self, body: dict, job: GRPOJob | None, memory: JobMemory, now: datetime
    ) -> tuple[admission.Admission | None, dict | None, kueue.Priority | None]:
        """(admission, Workload, priority for a new Workload) of a job Kueue queues; Nones for
        any other. Without --kueue a queue label gets one Warning Event, and the job runs."""
        meta = body["metadata"]
        queue_name = kueue.queue_name(meta.get("labels"))
        if queue_name and not self.kueue and not memory.kueue_warned:
            memory.kueue_warned = True
            text = f"{names.KUEUE_QUEUE_LABEL}={queue_name} is ignored: the operator runs without --kueue"
            self.kube.event(body, "Warning", "KueueDisabled", text, status.timestamp(now))
        if not (queue_name and self.kueue and job is not None):
            return None, None, None
        workload = self.kube.get(
            kueue.API_VERSION, "Workload", meta["namespace"], names.workload(meta["name"])
        )
        queue, priority = admission.read(queue_name, workload), None
        if workload is None:
            try:
                priority = self._priority(meta, job)
            except LookupError as e:  # no Workload until it exists: the status says why
                queue = dataclasses.replace(queue, message=str(e), blocked=True)
        return queue, workload, priority

    def _priority(self, meta: dict, job: GRPOJob) -> kueue.Priority | None:
        """As Kueue's integrations resolve it: the job's WorkloadPriorityClass label, else the
        pods' PriorityClass. A class that does not exist is an error Kueue would refuse too."""
        wpc = (meta.get("labels") or {}).get(kueue.PRIORITY_LABEL)
        if wpc:
            found = self.kube.get_cluster_scoped(kueue.API_VERSION, "workloadpriorityclasses", wpc)
            group, kind, name = "kueue.x-k8s.io", "WorkloadPriorityClass", wpc
        elif job.spec.scheduling.priority_class_name:
            name = job.spec.scheduling.priority_class_name
            found = self.kube.get_cluster_scoped("scheduling.k8s.io/v1", "priorityclasses", name)
            group, kind = "scheduling.k8s.io", "PriorityClass"
        else:
            return None
        if found is None:
            raise LookupError(f"{kind} {name!r} does not exist; create it or fix the job")
        return kueue.Priority(group, kind, name, int(found.get("value", 0)))

    def _sync_workload(
        self,
        body: dict,
        job: GRPOJob,
        rendered: render.Rendered,
        queue: admission.Admission,
        workload: dict | None,
        priority: kueue.Priority | None,
        decision: status.Decision,
        pods: list[dict],
        now: datetime,
    ) -> None:
        """Keep the job's Kueue Workload in step, as Kueue's own job integrations do: one per
        queued job while it wants to run, back in the queue after an eviction once its pods
        are gone, Finished when the job ends (Kueue frees the quota)."""
        meta = body["metadata"]
        namespace, wl_name = meta["namespace"], names.workload(meta["name"])
        phase = decision.status.phase
        if phase in TERMINAL_PHASES:
            if workload is not None and not queue.finished:
                done = admission.finished(workload, phase == Phase.SUCCEEDED, decision.status.message, now)
                self.kube.patch_status_of(workload, done)
            return
        if job.spec.run_policy.suspend:  # the owner stopped it: give back the quota and the queue place
            if workload is not None:
                self.kube.delete(kueue.API_VERSION, "Workload", namespace, wl_name)
            return
        spec = job.spec
        counts = {names.ROLE_TRAINER: spec.trainer.replicas, names.ROLE_ROLLOUT: spec.rollout.replicas}
        if workload is None:
            if queue.blocked:  # the status says why
                return
            templates = {
                child["metadata"]["name"]: child["spec"]["template"]
                for child in rendered.children
                if child["kind"] == "StatefulSet"
            }
            by_role = {role: templates[names.statefulset(meta["name"], role)] for role in kueue.ROLES}
            obj = kueue.workload(
                name=meta["name"],
                namespace=namespace,
                uid=meta["uid"],
                queue=queue.queue,
                templates=by_role,
                counts=counts,
                priority=priority,
            )
            self.kube.create(obj)
        elif not queue.reserved and kueue.pod_set_counts(workload) != counts:
            # Replicas changed while queued: a new Workload asks for the new counts.
            self.kube.delete(kueue.API_VERSION, "Workload", namespace, wl_name)
        elif queue.evicted is not None and queue.reserved and not pods:
            self.kube.patch_status_of(workload, admission.cleared(workload, now))

    def _zone(self, job: GRPOJob, meta: dict, memory: JobMemory, attempt: int) -> str | None:
        """The gang's zone, chosen once per attempt from the nodes of its instance type, or read
        back from the running gang by a replica that has no memory of the choice."""
        trainer = job.spec.trainer
        if trainer.instance_type is None or ZONE_KEY in trainer.node_selector:
            return None
        if memory.zone is None or memory.zone[0] != attempt:
            sts_name = names.statefulset(meta["name"], names.ROLE_TRAINER)
            live = self.kube.get("apps/v1", "StatefulSet", meta["namespace"], sts_name)
            known, zone = placement.zone_of_running_gang(live, attempt)
            if not known:
                nodes = self.kube.list_nodes(f"{INSTANCE_TYPE_LABEL}={trainer.instance_type}")
                zone = placement.choose_zone(nodes, trainer.replicas)
            memory.zone = (attempt, zone)
        return memory.zone[1]

    def _apply_children(self, rendered: render.Rendered, memory: JobMemory, body: dict) -> None:
        """Server-side apply each child whose desired hash differs from what the cluster has."""
        verify = time.monotonic() - memory.verified_at > self.verify_seconds
        for child in rendered.children:
            obj, digest = with_hash(child)
            key = child_key(child)
            if not verify and memory.applied.get(key) == digest:
                continue
            if verify or key not in memory.applied:
                meta = child["metadata"]
                live = self.kube.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])
                if live and (live["metadata"].get("annotations") or {}).get(HASH_ANNOTATION) == digest:
                    memory.applied[key] = digest
                    continue
            self.kube.apply(obj)
            memory.applied[key] = digest
        if verify:
            memory.verified_at = time.monotonic()
        if not memory.token_ok:
            meta = body["metadata"]
            if self.kube.get("v1", "Secret", meta["namespace"], names.token_secret(meta["name"])) is None:
                secret = render.token_secret(
                    name=meta["name"],
                    namespace=meta["namespace"],
                    uid=meta["uid"],
                    token=secrets.token_urlsafe(32),
                )
                self.kube.create(secret)
            memory.token_ok = True

    def _delete_stale(self, namespace: str, pods: list[dict], *, attempt: int, obs, running: bool) -> None:
        """Delete trainer pods of older attempts (a gang restart) and failed rollout pods."""
        for pod in pods:
            meta = pod["metadata"]
            gone = (pod.get("spec") or {}).get("nodeName") in self.gone_nodes
            if meta.get("deletionTimestamp") and not gone:
                continue  # already going; pods of deleted nodes would wait for the pod GC
            role = meta.get("labels", {}).get(names.LABEL_ROLE)
            stale = role == names.ROLE_TRAINER and observe.pod_attempt(pod) != attempt
            failed_rollout = running and meta["name"] in obs.failed_rollout_pods
            if stale or failed_rollout or (gone and meta.get("deletionTimestamp")):
                self.kube.delete_pod(namespace, meta["name"], uid=meta.get("uid"), force=gone)

    def _write_status(self, body: dict, new: GRPOJobStatus) -> None:
        """Merge-patch only the operator's fields that changed; progress belongs to rank 0."""
        current = body.get("status") or {}
        wanted = new.model_dump(by_alias=True, mode="json")
        patch = {k: wanted.get(k) for k in OPERATOR_STATUS_FIELDS if wanted.get(k) != current.get(k)}
        if patch:
            self.kube.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], patch)
            body["status"] = {**current, **patch}

    def _emit(self, body: dict, events, memory: JobMemory, rendered, generation: int, now: datetime) -> None:
        stamp = status.timestamp(now)
        for event_type, reason, message in events:
            self.kube.event(body, event_type, reason, message, stamp)
        if rendered and rendered.warnings and memory.warned_generation != generation:
            text = "; ".join(rendered.warnings)
            self.kube.event(body, "Warning", "TemplateConflict", f"operator fields kept: {text}", stamp)
        memory.warned_generation = generation


def _old_status(body: dict) -> GRPOJobStatus:
    try:
        return GRPOJobStatus.model_validate(body.get("status") or {})
    except ValidationError:
        log.warning(
            "status of %s/%s does not parse; starting afresh",
            body["metadata"]["namespace"],
            body["metadata"]["name"],
        )
        return GRPOJobStatus()
