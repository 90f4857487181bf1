"""The trainer gang's `epBackend: auto` choice, announced once: Events and counters.

Trainer rank 0 reports the choice in `status.progress` before the first step (the attempt's start
record) and again with every step: `epBackend`, `epBackendCandidates` (each candidate's time, or
"skipped: <reason>" when the layout or the installed library refused it, or "failed: <reason>")
and `epBackendFailures`. `controller.reconcile` turns what it has not announced yet into Events (the
choice: Normal EPBackendChosen naming every candidate's time or reason; each failed candidate:
Warning EPBackendFailed) and counts failed and skipped candidates
(`grpo_operator_ep_backend_failures_total` / `_refused_total{backend}`), remembering each
announcement in the job's memory: the report repeats every step, the announcement must not.
"""

from grpo_operator.api.report import SKIPPED
from grpo_operator.api.status import Progress

CHOSEN, FAILED, REFUSED = "EPBackendChosen", "EPBackendFailed", "refused"
Announcement = tuple[str, str, str]  # (kind: CHOSEN | FAILED | REFUSED, backend, why)


def fresh(progress: Progress | None, announced: set[Announcement]) -> list[Announcement]:
    """What the report says that was not announced yet, in a stable order: the choice first."""
    if progress is None:
        return []
    out: list[Announcement] = []
    if progress.ep_backend:
        why = "; ".join(f"{k} {v}" for k, v in sorted(progress.ep_backend_candidates.items()))
        out.append((CHOSEN, progress.ep_backend, why))
    out += sorted((FAILED, backend, why) for backend, why in progress.ep_backend_failures.items())
    out += sorted(
        (REFUSED, backend, text.removeprefix(SKIPPED))
        for backend, text in progress.ep_backend_candidates.items()
        if text.startswith(SKIPPED)
    )
    return [a for a in out if a not in announced]


def event(announcement: Announcement) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event that says it, or None (a refused candidate, e.g. DeepEP v1
    for a group across nodes, is expected: it is counted and named in the choice's Event)."""
    kind, backend, why = announcement
    if kind == CHOSEN:
        return "Normal", CHOSEN, f"the trainer gang runs EP backend {backend} (epBackend auto: {why})"
    if kind == FAILED:
        return "Warning", FAILED, f"epBackend auto: candidate {backend} failed, the next one was tried: {why}"
    return None
