"""`epBackend: auto` candidates that failed in the trainer gang, announced once each.

Trainer rank 0 reports them in `status.progress.epBackendFailures` (candidate -> reason; `auto`
then tried the next candidate). `controller.reconcile` turns each failure it has not announced yet
into a Warning Event and one count of `grpo_operator_ep_backend_failures_total{backend}`, and
remembers it in the job's memory: the report repeats every step, the announcement must not.
"""

from grpo_operator.api.status import Progress

REASON = "EPBackendFailed"
Failure = tuple[str, str]  # (candidate, reason)


def fresh(progress: Progress | None, announced: set[Failure]) -> list[Failure]:
    """The reported failures not announced yet, in a stable order."""
    reported = progress.ep_backend_failures if progress is not None else {}
    return sorted((backend, why) for backend, why in reported.items() if (backend, why) not in announced)


def event(failure: Failure) -> tuple[str, str, str]:
    backend, why = failure
    return "Warning", REASON, f"epBackend auto: candidate {backend} failed, the next one was tried: {why}"
