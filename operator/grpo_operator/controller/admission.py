"""What a Kueue Workload says about its GRPOJob, and the status Kueue expects written back.

Pure. `read` turns the Workload (or its absence) into the gate `status.decide` applies; the
two status bodies follow the protocol of Kueue's own job integrations (its jobframework
reconciler): after an evicted job's pods are gone, the job's controller lifts the quota
reservation so Kueue queues it again; when the job ends, it marks the Workload Finished so
Kueue frees the quota.
"""

from dataclasses import dataclass, field
from datetime import datetime

ADMITTED, QUOTA_RESERVED, EVICTED = "Admitted", "QuotaReserved", "Evicted"
FINISHED, REQUEUED = "Finished", "Requeued"
# Evictions after which Kueue expects the workload back in the queue by itself.
REQUEUE_REASONS = frozenset({"Preempted", "NodeFailures"})


@dataclass(frozen=True)
class Admission:
    """A queued job's standing with Kueue."""

    queue: str
    admitted: bool = False
    evicted: str | None = None  # the eviction message while Evicted=True
    reserved: bool = False  # holds quota (status.admission set)
    finished: bool = False
    flavors: dict[str, list[str]] = field(default_factory=dict)  # pod set → ResourceFlavor names
    counts: dict[str, int] = field(default_factory=dict)  # pod set → admitted pods
    message: str = ""
    blocked: bool = False  # its Workload cannot be made yet (message says why)

    @property
    def runs(self) -> bool:
        return self.admitted and self.evicted is None

    def why_waiting(self) -> str:
        if self.evicted is not None:
            return f"evicted by Kueue: {self.evicted}"
        detail = f": {self.message}" if self.message else ""
        return f"waiting for Kueue to admit it from LocalQueue {self.queue!r}{detail}"


def _condition(conditions: list[dict], kind: str) -> dict | None:
    return next((c for c in conditions if c.get("type") == kind), None)


def _true(conditions: list[dict], kind: str) -> bool:
    c = _condition(conditions, kind)
    return c is not None and c.get("status") == "True"


def read(queue: str, workload: dict | None) -> Admission:
    if workload is None:
        return Admission(queue, message="creating its Workload")
    status = workload.get("status") or {}
    conditions = status.get("conditions") or []
    admission = status.get("admission") or {}
    flavors, counts = {}, {}
    for assignment in admission.get("podSetAssignments") or []:
        flavors[assignment["name"]] = sorted(set((assignment.get("flavors") or {}).values()))
        if assignment.get("count") is not None:
            counts[assignment["name"]] = assignment["count"]
    evicted = _condition(conditions, EVICTED) or {}
    pending = _condition(conditions, QUOTA_RESERVED)
    return Admission(
        queue,
        admitted=_true(conditions, ADMITTED) and bool(admission),
        evicted=evicted.get("message") or evicted.get("reason", "") if _true(conditions, EVICTED) else None,
        reserved=bool(admission),
        finished=_true(conditions, FINISHED),
        flavors=flavors,
        counts=counts,
        message=(pending or {}).get("message", "") if not _true(conditions, QUOTA_RESERVED) else "",
    )


def _set(
    conditions: list[dict], kind: str, status: bool, reason: str, message: str, now: datetime, generation: int
) -> list[dict]:
    """Kubernetes condition semantics: lastTransitionTime moves only when the status does."""
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    value = "True" if status else "False"
    old = _condition(conditions, kind)
    new = {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message[:32768],
        "observedGeneration": generation,
        "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == value else stamp,
    }
    return [c for c in conditions if c.get("type") != kind] + [new]


def cleared(workload: dict, now: datetime) -> dict:
    """Status after an evicted job stopped: no admission, quota released, back in the queue."""
    status = workload.get("status") or {}
    conditions = list(status.get("conditions") or [])
    gen = workload["metadata"].get("generation", 1)
    evicted = _condition(conditions, EVICTED) or {}
    reason, message = evicted.get("reason", "Evicted"), evicted.get("message", "evicted")
    conditions = _set(conditions, REQUEUED, reason in REQUEUE_REASONS, reason, message, now, gen)
    conditions = _set(conditions, QUOTA_RESERVED, False, "Pending", message, now, gen)
    no_reservation = "The workload has no reservation"
    conditions = _set(conditions, ADMITTED, False, "NoReservation", no_reservation, now, gen)
    return {"admission": None, "conditions": conditions}


def finished(workload: dict, succeeded: bool, message: str, now: datetime) -> dict:
    """Status of a Workload whose job ended: Kueue frees its quota."""
    conditions = list((workload.get("status") or {}).get("conditions") or [])
    gen = workload["metadata"].get("generation", 1)
    reason = "Succeeded" if succeeded else "Failed"
    return {"conditions": _set(conditions, FINISHED, True, reason, message, now, gen)}
