"""A reconcile pass that raised, reported on its job instead of retried in silence.

Called by `controller.reconcile` when a pass raises (the API server refused an object, a child's
name belongs to someone else, a bug): the job gets a ReconcileError condition and status message
naming the reason, one Warning Event per distinct failure, and the pass is retried with
exponential backoff. The condition clears on the next pass that succeeds (`status.recovered`).
"""

import json
import logging
from datetime import UTC, datetime

from pydantic import ValidationError

from grpo_operator.api.job import API_VERSION, KIND
from grpo_operator.api.status import GRPOJobStatus, Reason
from grpo_operator.controller import status
from grpo_operator.controller.kube import ApiException, Kube

BACKOFF_S, MAX_BACKOFF_S = 5.0, 300.0  # retried after 5, 10, 20 ... 300 s
MAX_MESSAGE = 1024
log = logging.getLogger("grpo_operator.reconcile")


def backoff_seconds(failures: int) -> float:
    """Delay before the next pass after `failures` failed passes in a row (>= 1)."""
    return min(BACKOFF_S * 2 ** min(failures - 1, 16), MAX_BACKOFF_S)


def describe(error: Exception) -> tuple[str, str]:
    """(reason, message): an error that names its own `reason` (a class attribute, such as
    `children.ChildConflict`) keeps it; the API server's refusals quote its message."""
    if isinstance(error, ApiException):
        try:
            detail = json.loads(error.body or "{}").get("message") or error.reason
        except ValueError:
            detail = error.reason
        return Reason.RECONCILE_FAILED, f"the API server answered {error.status}: {detail}"[:MAX_MESSAGE]
    reason = getattr(type(error), "reason", None)
    reason = reason if isinstance(reason, str) else Reason.RECONCILE_FAILED
    return reason, f"{type(error).__name__}: {error}"[:MAX_MESSAGE]


def report(kube: Kube, namespace: str, name: str, error: Exception, reported: str | None) -> str | None:
    """Best effort (the API server may be what failed): the condition always, the Event unless
    `reported` is this same failure. The Event goes first, so whoever sees the condition finds
    the Event too. Returns the failure now reported."""
    reason, message = describe(error)
    try:
        body = kube.get(API_VERSION, KIND, namespace, name)
        if body is None:
            return reported
        now = datetime.now(UTC)
        if reported != f"{reason}: {message}":
            try:
                kube.event(body, "Warning", reason, message, status.timestamp(now))
            except Exception as e:
                log.warning("could not post the Event for %s/%s: %s", namespace, name, e)
        try:
            current = GRPOJobStatus.model_validate(body.get("status") or {})
        except ValidationError:
            current = GRPOJobStatus()
        status.failed_pass(current, reason, message, now)
        wire = current.model_dump(by_alias=True, mode="json")
        kube.patch_status(namespace, name, {"conditions": wire["conditions"], "message": wire["message"]})
        return f"{reason}: {message}"
    except Exception as e:
        log.warning("could not report the failed pass of %s/%s: %s", namespace, name, e)
        return reported
