"""One reconcile pass of one GRPOJob: snapshot → decide → apply → status, writing only diffs.

Called by the per-job kopf daemon in `controller.handlers` (in an executor thread). The pass
reads the job, its pods and (for a queued job) its Kueue gate; `status.decide` turns that into
a decision; the children are rendered once from the decision and applied; the status is
patched last. Order matters for restart safety: a gang restart is recorded in status
(restarts = attempt) before any pod is deleted, and stale-attempt trainer pods are deleted on
every pass, so an operator killed at any point converges on the next pass without duplicates.
The map of the house: docs/architecture.md.
"""

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError

from grpo_operator import render
from grpo_operator.api import signals
from grpo_operator.api.job import API_VERSION, KIND, GRPOJob
from grpo_operator.api.status import TERMINAL_PHASES, GRPOJobStatus
from grpo_operator.controller import ep_backend, failures, metrics, observe, placement, status
from grpo_operator.controller.children import AppliedMemory, ChildApplier
from grpo_operator.controller.kube import Kube
from grpo_operator.controller.queueing import Gate, Queueing, QueueMemory
from grpo_operator.controller.runnable import runnable
from grpo_operator.instance_types import InstanceTable
from grpo_operator.render import names
from grpo_operator.render.pods import ZONE_KEY

# Every status field but progress, which trainer rank 0 owns.
OPERATOR_STATUS_FIELDS = tuple(f.alias or n for n, f in GRPOJobStatus.model_fields.items() if n != "progress")
GONE = -1.0  # what `reconcile` returns once the job is deleted: its worker ends
log = logging.getLogger("grpo_operator.reconcile")


@dataclass
class JobMemory:
    """What one job's worker remembers between passes (lost on restart, which only costs reads)."""

    children: AppliedMemory = field(default_factory=AppliedMemory)
    warned_generation: int | None = None
    zone: tuple[int, str | None] | None = None  # (attempt, zone) of the trainer gang
    avoid: tuple[int, tuple[str, ...]] | None = None  # (attempt, nodes lost when it began)
    verdicts: deque = field(default_factory=deque)
    queue: QueueMemory = field(default_factory=QueueMemory)
    last_good: GRPOJob | None = None  # the last spec that rendered: a refused live edit runs on it
    failures: int = 0  # passes that raised in a row (backoff)
    generation: int | None = None  # of the job as the last pass read it
    reported: str | None = None  # the failure last reported as an Event
    ep_announced: set = field(default_factory=set)  # epBackend auto: choice and candidates announced
    signals_said: set = field(default_factory=set)  # api.signals reasons posted as Warning Events


@dataclass
class Snapshot:
    """What one pass reads before deciding anything."""

    body: dict
    old: GRPOJobStatus
    job: GRPOJob | None  # what runs: None when the spec does not parse or cannot render
    error: status.SpecError | None  # why the current spec cannot run
    pods: list[dict]
    obs: observe.Observation
    gate: Gate | None  # a queued job's Kueue standing


# What a Failed job's pods are stopped through: the one that exists of each role's kinds
STOPPABLE = (
    ("apps/v1", "StatefulSet", names.ROLE_TRAINER),
    ("apps/v1", "StatefulSet", names.ROLE_ROLLOUT),
    (names.LWS_API_VERSION, "LeaderWorkerSet", names.ROLE_ROLLOUT),
    ("apps/v1", "StatefulSet", names.ROLE_REWARD),  # spec.reward.model's servers, if any
)


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        table: InstanceTable,
        *,
        verify_seconds: float = 300.0,
        kueue: bool = False,
        metrics_from: list[dict] | None = None,
    ) -> None:
        self.kube = kube
        self.table = table
        self.children = ChildApplier(kube, verify_seconds=verify_seconds)
        self.metrics_from = metrics_from or []  # NetworkPolicy peers that may scrape rollout /metrics
        self.queueing = Queueing(kube, enabled=kueue)  # queue labelled jobs through Kueue Workloads
        self.lost_nodes: set[str] = set()  # deleted or not Ready: their trainer pods fail the gang
        self.gone_nodes: set[str] = set()  # deleted: their pods are force-deleted

    def reconcile(self, namespace: str, name: str, memory: JobMemory) -> float | None:
        """One pass; returns seconds until a pass is due anyway (deadline, TTL, backoff after a
        failed pass), None, or GONE once the job is deleted. A pass that raises is reported on
        the job, never raised."""
        started = time.perf_counter()
        pending = [memory.verdicts.popleft() for _ in range(len(memory.verdicts))]
        try:
            with metrics.PASSES.running(f"{namespace}/{name}"):
                delay = self._pass(namespace, name, memory, pending)
        except Exception as e:
            memory.verdicts.extendleft(reversed(pending))
            metrics.RECONCILE_ERRORS.inc()
            metrics.RECONCILES.labels(result="error").inc()
            memory.failures += 1
            backoff = failures.backoff_seconds(memory.failures)
            log.warning("pass of %s/%s failed, retrying in %gs: %s", namespace, name, backoff, e)
            memory.reported = failures.report(self.kube, namespace, name, e, memory.reported)
            return backoff
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        memory.failures, memory.reported = 0, None
        metrics.RECONCILES.labels(result="ok").inc()
        return delay

    def _pass(self, namespace: str, name: str, memory: JobMemory, pending: list) -> float | None:
        body = self.kube.get(API_VERSION, KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return GONE
        now = datetime.now(UTC)
        generation = memory.generation = body["metadata"].get("generation", 1)
        snap = self._snapshot(body, memory, pending, now)
        if snap.error is not None and snap.job is None and _running(snap.old):
            # A live edit that cannot run, and no memory of the spec that ran: touch nothing.
            decision = status.rejected_update(snap.old, generation, snap.error, now)
            self._write_status(body, decision.status)
            self._emit(body, decision.events, memory, None, now)
            return None
        decision = status.decide(
            spec=snap.job.spec if snap.job else None,
            generation=generation,
            old=snap.old,
            obs=snap.obs,
            now=now,
            spec_error=snap.error,
            queue=snap.gate.admission if snap.gate else None,
        )
        status.recovered(decision.status, now)
        if decision.status.rollout is not None:  # what the scale subresource's HPA/KEDA select on
            spans = snap.job is not None and snap.job.spec.rollout.spans_nodes
            decision.status.rollout.selector = names.server_selector(body["metadata"]["name"], spans=spans)
        if decision.gang_restart:
            # Record the new attempt first: a crash after this line still restarts the gang.
            self._write_status(body, decision.status)
            metrics.GANG_RESTARTS.inc()
        rendered = self._apply(snap, decision, memory, now)
        if not decision.gang_restart:
            self._write_status(body, decision.status)
        ep_news = ep_backend.fresh(snap.old.progress, memory.ep_announced)
        decision.events += [e for e in map(ep_backend.event, ep_news) if e is not None]
        said = _signal_warnings(snap, memory.signals_said)
        decision.events += [("Warning", reason, message) for reason, message in said]
        self._emit(body, decision.events, memory, rendered, now)
        for reason, _ in said:  # once per job, after its Event went out
            metrics.SIGNAL_WARNINGS.labels(reason=reason).inc()
            memory.signals_said.add(reason)
        for kind, backend, why in ep_news:  # once each, after its Event went out
            if kind == ep_backend.FAILED:
                metrics.EP_BACKEND_FAILURES.labels(backend=backend).inc()
            elif kind == ep_backend.REFUSED:
                metrics.EP_BACKEND_REFUSED.labels(backend=backend).inc()
            memory.ep_announced.add((kind, backend, why))
        metrics.set_phase(f"{namespace}/{name}", decision.status.phase)
        if decision.delete_job:
            log.info("deleting %s/%s: ttlSecondsAfterFinished passed", namespace, name)
            self.kube.delete_job(namespace, name)
        return decision.requeue_after

    def _snapshot(self, body: dict, memory: JobMemory, pending: list, now: datetime) -> Snapshot:
        meta = body["metadata"]
        old = _old_status(body)
        job, error = runnable(body, self.table)
        if error is None:
            memory.last_good = job
        elif _running(old):
            job = memory.last_good  # a refused live edit: the job runs on what it ran
        born = meta.get("creationTimestamp", "")  # RFC 3339 in UTC: compares as text
        pods = self.kube.list_pods(meta["namespace"], names.label_selector(meta["name"]))
        pods = [p for p in pods if _ours(p["metadata"], meta["uid"], born)]  # not a namesake's
        obs = observe.summarize(pods, attempt=old.restarts, lost_nodes=frozenset(self.lost_nodes))
        uid = meta["uid"]
        obs.verdicts += [v for v in pending if (v.job_uid == uid if v.job_uid else v.created >= born)]
        gate = self.queueing.gate(body, job, memory.queue, now)
        return Snapshot(body, old, job, error, pods, obs, gate)

    def _apply(
        self, snap: Snapshot, decision: status.Decision, memory: JobMemory, now: datetime
    ) -> render.Rendered | None:
        """Make the cluster match the decision: children rendered once and applied, stale pods
        deleted, the Kueue Workload in step. Returns what was rendered (None for a bad spec)."""
        body, job, meta = snap.body, snap.job, snap.body["metadata"]
        if job is None:
            if any(not p["metadata"].get("deletionTimestamp") for p in snap.pods):
                # The spec no longer renders (say an edit named an unknown instance type): a
                # Failed job must not keep GPUs, so stop what the last good spec started.
                for api_version, kind, role in STOPPABLE:
                    self.kube.scale(
                        api_version, kind, meta["namespace"], names.statefulset(meta["name"], role), 0
                    )
            return None
        rendered = self._render(body, job, memory, decision, snap.gate)
        self.children.apply(rendered, memory.children, body)
        self._stop_removed_reward(meta, snap.old, job)
        self._delete_stale(meta["namespace"], snap.pods, decision, snap.obs)
        if snap.gate is not None:
            self.queueing.sync(body, job, rendered, snap.gate, decision, snap.pods, now)
        return rendered

    def _render(
        self, body: dict, job: GRPOJob, memory: JobMemory, decision: status.Decision, gate: Gate | None
    ) -> render.Rendered:
        """The children the decision asks for: this attempt's gang, running or scaled to zero,
        on the admitted Kueue flavors, in the gang's zone."""
        meta, attempt = body["metadata"], decision.status.restarts
        place = self.queueing.placement(gate, job, memory.queue, running=decision.running)
        # A flavor that names a zone is where Kueue reserved the quota: it wins over our choice.
        zoned = place.flavors is not None and ZONE_KEY in place.flavors[names.ROLE_TRAINER].node_labels
        zone = None
        if decision.running and not zoned:
            if memory.zone is None or memory.zone[0] != attempt:  # chosen once per attempt
                memory.zone = (attempt, placement.gang_zone(self.kube, job, meta, attempt))
            zone = memory.zone[1]
        if memory.avoid is None or memory.avoid[0] != attempt:  # fixed per attempt: no template churn
            memory.avoid = (attempt, tuple(sorted(self.lost_nodes)))
        out = render.render(
            job,
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=meta.get("generation", 1),
            attempt=attempt,
            running=decision.running,
            zone=zone,
            avoid_nodes=memory.avoid[1],
            instance_types=self.table,
            flavors=place.flavors,
            rollout_replicas=_rollout_count(decision.status, place.rollout_cap),
            metrics_from=self.metrics_from,
        )
        out.warnings.extend(place.warnings)
        return out

    def _stop_removed_reward(self, meta: dict, old: GRPOJobStatus, job: GRPOJob) -> None:
        """spec.reward.model removed from a live job (its status still counts reward servers): the
        reward StatefulSet is scaled to zero, once, so its GPUs go back; the role's other children stay
        until the job is deleted (the operator patches children, it never deletes them)."""
        if old.reward is not None and job.spec.reward.model is None:
            sts = names.statefulset(meta["name"], names.ROLE_REWARD)
            self.kube.scale("apps/v1", "StatefulSet", meta["namespace"], sts, 0)

    def _delete_stale(
        self, namespace: str, pods: list[dict], decision: status.Decision, obs: observe.Observation
    ) -> None:
        """Delete trainer pods of older attempts (a gang restart) and failed rollout and reward model
        server pods (their StatefulSets make them again; the gang runs on)."""
        attempt, running = decision.status.restarts, decision.running
        for pod in pods:
            meta = pod["metadata"]
            gone = (pod.get("spec") or {}).get("nodeName") in self.gone_nodes
            if meta.get("deletionTimestamp") and not gone:
                continue  # already going; pods of deleted nodes would wait for the pod GC
            role = meta.get("labels", {}).get(names.LABEL_ROLE)
            stale = role == names.ROLE_TRAINER and observe.pod_attempt(pod) != attempt
            failed_server = running and meta["name"] in (*obs.failed_rollout_pods, *obs.failed_reward_pods)
            if stale or failed_server or (gone and meta.get("deletionTimestamp")):
                why = f"of attempt {observe.pod_attempt(pod)}" if stale else "failed or node gone"
                log.info("deleting pod %s/%s (%s, now attempt %s)", namespace, meta["name"], why, attempt)
                self.kube.delete_pod(namespace, meta["name"], uid=meta.get("uid"), force=gone)

    def _write_status(self, body: dict, new: GRPOJobStatus) -> None:
        """Merge-patch only the operator's fields that changed; progress belongs to rank 0."""
        current = body.get("status") or {}
        wanted = new.model_dump(by_alias=True, mode="json", exclude_none=True)  # as the server stores it
        patch = {k: wanted.get(k) for k in OPERATOR_STATUS_FIELDS if wanted.get(k) != current.get(k)}
        if patch:
            self.kube.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], patch)
            body["status"] = {**current, **patch}

    def _emit(
        self, body: dict, events: list, memory: JobMemory, rendered: render.Rendered | None, now: datetime
    ) -> None:
        stamp, generation = status.timestamp(now), body["metadata"].get("generation", 1)
        for event_type, reason, message in events:
            self.kube.event(body, event_type, reason, message, stamp)
        if rendered and rendered.warnings and memory.warned_generation != generation:
            text = "; ".join(rendered.warnings)
            self.kube.event(body, "Warning", "TemplateConflict", f"operator fields kept: {text}", stamp)
        memory.warned_generation = generation


def _signal_warnings(snap: Snapshot, said: set) -> list[tuple[str, str]]:
    """What trainer rank 0's last report says is wrong with the learning signal, not said yet."""
    progress, job = snap.old.progress, snap.job
    if progress is None or job is None:
        return []
    found = signals.warnings(
        reward_timeouts=progress.reward_timeouts,
        cut_fraction=progress.episodes_cut_fraction,
        max_new_tokens=job.spec.algorithm.max_new_tokens,
    )
    return [(reason, message) for reason, message in found if reason not in said]


def _rollout_count(new: GRPOJobStatus, kueue_cap: int | None) -> int | None:
    """Rollout servers to render: the decided (autoscaled) count, within what Kueue admitted."""
    counts = [n for n in (new.rollout.replicas if new.rollout else None, kueue_cap) if n is not None]
    return min(counts) if counts else None


def _ours(pod_meta: dict, uid: str, born: str) -> bool:
    """A pod of this job, not of a deleted namesake: by its job-uid label, else (a pod made
    before the label existed) by its creation time, which has only a second's resolution."""
    labelled = (pod_meta.get("labels") or {}).get(names.LABEL_JOB_UID)
    return labelled == uid if labelled else pod_meta.get("creationTimestamp", "") >= born


def _running(old: GRPOJobStatus) -> bool:
    """The job has pods to keep: started, not suspended (no start time), not finished."""
    return old.start_time is not None and old.phase not in TERMINAL_PHASES


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
