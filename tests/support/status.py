"""A GRPOJob spec, its pods as the API server lists them, and one lifecycle decision over them: the
inputs of the lifecycle tests (controller.status, controller.observe) and of the tests built on them."""

from datetime import UTC, datetime

from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import GRPOJobStatus
from grpo_operator.controller import observe, status

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def spec(**run_policy) -> GRPOJobSpec:
    """Two trainer pods of one rank and two rollout servers, under `run_policy`."""
    return GRPOJobSpec.model_validate(
        {
            "model": {"path": "/m"},
            "dataset": {"path": "/d"},
            "reward": {"functions": [{"builtin": "math"}]},
            "trainer": {"replicas": 2, "processesPerPod": 1},
            "rollout": {"replicas": 2},
            "runPolicy": run_policy,
        }
    )


def pod(
    role: str,
    index: int,
    *,
    attempt: int = 0,
    ready=True,
    node="n1",
    phase="Running",
    term=None,
    deleting=False,
):
    p = {
        "metadata": {
            "name": f"j-{role}-{index}",
            "labels": {
                "grpo.dev/role": role,
                "grpo.dev/attempt": str(attempt),
                "apps.kubernetes.io/pod-index": str(index),
            },
        },
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }
    if term is not None:
        p["status"]["containerStatuses"] = [{"name": role, "state": {"terminated": {"exitCode": term}}}]
    if deleting:
        p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return p


def all_ready(attempt: int = 0) -> list[dict]:
    """Every pod of spec() running and Ready in `attempt`."""
    return [pod(r, i, attempt=attempt) for r in ("trainer", "rollout") for i in range(2)]


def decide(pods, old=None, s=None, now=NOW, **kw) -> status.Decision:
    """One reconcile's verdict on `pods` from status `old`, at generation 3, as the controller decides."""
    old = old or GRPOJobStatus()
    obs = observe.summarize(pods, attempt=old.restarts)
    return status.decide(spec=s or spec(), generation=3, old=old, obs=obs, now=now, **kw)


def cond(st: GRPOJobStatus, ctype: str):
    return next(c for c in st.conditions if c.type == ctype)
