"""Whether a GRPOJob object's spec can run: it parses, it renders, and it asks for nothing unapproved.

Pure. Called by `controller.reconcile` at the start of every pass, before anything is decided:
a bad object becomes a `status.SpecError` (a status message and a condition), never an
exception, and is never rendered. The escalation check is the operator's second line behind
the chart's admission policy (docs/security.md): a job created before the policy, or while it
was off, still gets no privileged pods.
"""

from pydantic import ValidationError

from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.status import Reason
from grpo_operator.controller.status import SpecError
from grpo_operator.instance_types import InstanceTable
from grpo_operator.validation import escalation


def runnable(body: dict, table: InstanceTable) -> tuple[GRPOJob | None, SpecError | None]:
    """(job, None), or (None, why) for a spec that does not parse, cannot render, or asks for
    escalations nobody approved."""
    meta = body["metadata"]
    try:
        job = GRPOJob.model_validate({"metadata": {}, "spec": body.get("spec") or {}})
        render.validate(job, name=meta["name"], namespace=meta["namespace"], instance_types=table)
    except ValidationError as e:
        where = ".".join(str(x) for x in e.errors()[0]["loc"])
        return None, SpecError(Reason.INVALID_SPEC, f"{where}: {e.errors()[0]['msg']}")
    except render.RenderError as e:
        return None, SpecError(Reason.INVALID_SPEC, str(e))
    refused = escalation.refusals(job, meta.get("annotations") or {})
    if refused:
        return None, SpecError(Reason.ESCALATION_REFUSED, "; ".join(refused))
    return job, None
