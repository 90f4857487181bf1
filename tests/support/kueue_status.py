"""What Kueue's scheduler writes, for e2e tests on a cluster with Kueue's CRDs but no Kueue.

Shared by tests/e2e/test_operator.py and test_helm_rbac.py, which play the scheduler's part (admit,
evict) as kwok plays the kubelet's.
"""

import time

KUEUE = ("kueue.x-k8s.io", "v1beta2")  # group, version


def condition(kind: str, status: bool, reason: str, message: str) -> dict[str, str]:
    """A Workload status condition as Kueue sets it."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state = "True" if status else "False"
    return {"type": kind, "status": state, "reason": reason, "message": message, "lastTransitionTime": now}
