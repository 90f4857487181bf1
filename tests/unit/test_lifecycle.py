"""One lifecycle for both runtimes: a table of trainer-gang histories, each replayed as cluster pods
through the controller's `status.decide` and as real local processes through the supervisor's
`gang_decision`; both must reach the same outcome, for the same reason, attempt after attempt."""

import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from grpo_operator.api.status import GRPOJobStatus, Phase, Reason
from grpo_operator.controller import observe, status
from grpo_operator.lifecycle import Outcome, gang_decision, seconds_left
from grpo_operator.local import supervisor
from grpo_operator.local.procs import PodCommand, PodProcess, stop_all

from tests.support.status import pod, spec

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
RUNNING, SIGKILL = None, "SIGKILL"  # a pod still running; one killed by SIGKILL (exit code 137)

# (name, backoffLimit, per attempt: each trainer pod's exit, expected (outcome, reason) per attempt)
HISTORIES = [
    ("still running", 3, [[RUNNING, RUNNING]], [(Outcome.RUN, None)]),
    ("rank 0 done", 3, [[0, RUNNING]], [(Outcome.SUCCEED, Reason.COMPLETED)]),
    ("rank 0 done wins over a peer's teardown", 3, [[0, 1]], [(Outcome.SUCCEED, Reason.COMPLETED)]),
    ("pod 1 exiting 0 alone decides nothing", 3, [[RUNNING, 0]], [(Outcome.RUN, None)]),
    (
        "a crash restarts, the new gang runs",
        3,
        [[1, RUNNING], [RUNNING, RUNNING]],
        [(Outcome.RESTART, Reason.TRAINER_FAILED), (Outcome.RUN, None)],
    ),
    ("a config error fails at once", 3, [[RUNNING, 3]], [(Outcome.FAIL, Reason.PERMANENT_ERROR)]),
    ("sysexits EX_CONFIG fails at once", 3, [[78, RUNNING]], [(Outcome.FAIL, Reason.PERMANENT_ERROR)]),
    (
        "a permanent error wins over another pod's crash",
        3,
        [[1, 3]],
        [(Outcome.FAIL, Reason.PERMANENT_ERROR)],
    ),
    (
        "restarts until the backoff limit",
        2,
        [[SIGKILL, RUNNING], [RUNNING, 1], [1, 1]],
        [
            (Outcome.RESTART, Reason.TRAINER_FAILED),
            (Outcome.RESTART, Reason.TRAINER_FAILED),
            (Outcome.FAIL, Reason.BACKOFF_LIMIT_EXCEEDED),
        ],
    ),
    ("backoffLimit 0 never restarts", 0, [[RUNNING, 2]], [(Outcome.FAIL, Reason.BACKOFF_LIMIT_EXCEEDED)]),
]


def _cluster(limit: int, attempts: list[list], expected: list) -> list[tuple[Outcome, str | None]]:
    """Each attempt's exits as a kubelet reports them, through the controller's pure lifecycle."""
    job, old, seen = spec(backoffLimit=limit), GRPOJobStatus(), []
    for exits in attempts[: len(expected)]:
        a = old.restarts
        pods = [pod("rollout", i) for i in range(2)]
        for i, code in enumerate(exits):
            term = 137 if code == SIGKILL else code
            phase = "Running" if term is None else "Succeeded" if term == 0 else "Failed"
            pods.append(pod("trainer", i, attempt=a, term=term, phase=phase, ready=term is None))
        obs = observe.summarize(pods, attempt=a)
        d = status.decide(spec=job, generation=1, old=old, obs=obs, now=NOW)
        reasons = {c.type: c.reason for c in d.status.conditions if c.status == "True"}
        if d.gang_restart:
            seen.append((Outcome.RESTART, reasons["Restarting"]))
        elif d.status.phase == Phase.SUCCEEDED:
            seen.append((Outcome.SUCCEED, reasons["Succeeded"]))
        elif d.status.phase == Phase.FAILED:
            seen.append((Outcome.FAIL, reasons["Failed"]))
        else:
            seen.append((Outcome.RUN, None))
        old = d.status
    return seen


def _command(index: int, code) -> PodCommand:
    body = {
        RUNNING: "import time; time.sleep(60)",
        SIGKILL: "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    }.get(code, f"import sys; sys.exit({code})")
    return PodCommand("trainer", index, [sys.executable, "-c", body], env={}, cwd=Path.cwd(), grace_s=1.0)


def _local(limit: int, attempts: list[list], expected: list, logs: Path) -> list[tuple[Outcome, str | None]]:
    """Each attempt's exits as real local processes, through the supervisor's decision."""
    seen, restarts = [], 0
    for exits in attempts[: len(expected)]:
        procs = [PodProcess.start(_command(i, c), logs, restarts) for i, c in enumerate(exits)]
        try:
            for proc, code in zip(procs, exits, strict=True):
                if code is not RUNNING:
                    proc.popen.wait(timeout=30)
            gang = supervisor.gang_decision(procs, restarts=restarts, backoff_limit=limit)
        finally:
            stop_all(procs, grace_s=1.0)
        seen.append((gang.outcome, gang.reason))
        restarts += gang.outcome == Outcome.RESTART
    return seen


@pytest.mark.parametrize(("name", "limit", "attempts", "expected"), HISTORIES, ids=[h[0] for h in HISTORIES])
def test_cluster_and_local_runs_reach_the_same_verdicts(name, limit, attempts, expected, tmp_path):
    assert _cluster(limit, attempts, expected) == expected
    assert _local(limit, attempts, expected, tmp_path) == expected


def test_no_verdicts_means_run_and_a_lost_node_restarts_with_its_own_reason():
    assert gang_decision([], restarts=0, backoff_limit=3).outcome == Outcome.RUN
    pods = [pod("trainer", 0, node="gone"), pod("trainer", 1)]
    obs = observe.summarize(pods, attempt=0, lost_nodes={"gone"})
    decision = gang_decision(obs.verdicts, restarts=0, backoff_limit=3)
    assert (decision.outcome, decision.reason) == (Outcome.RESTART, Reason.NODE_LOST)


def test_seconds_left_of_deadlines_and_ttls():
    assert seconds_left(10.0, None) is None
    assert seconds_left(10.0, 60) == 50.0
    assert seconds_left(60.0, 60) == 0.0
    assert seconds_left(3e9, 10**10) == 10**10 - 3e9  # no datetime arithmetic: no OverflowError


STATED = "ResumeFromNotFound: checkpoint.resumeFrom s3://b/ckpt/first: does not exist"
JUDGE = (
    "RewardModelMisconfigured: server http://j-rollout-0:8000 answered 422 reward_misconfigured: "
    "spec.reward.model.prompt names {answer}, which the row does not have"
)
DOWN = (
    "RewardModelUnavailable: the reward model servers (spec.reward.model, <job>-reward pods) scored "
    "nothing for 1203s (10 x spec.reward.model.timeoutSeconds = 1200s)"
)


@pytest.mark.parametrize(
    ("stated", "reason"),
    [
        (STATED, Reason.RESUME_FROM_NOT_FOUND),
        (JUDGE, Reason.REWARD_MODEL_MISCONFIGURED),
        (DOWN, Reason.REWARD_MODEL_UNAVAILABLE),
    ],
    ids=["resume-from", "reward-model", "reward-model-down"],
)
def test_a_reason_the_trainer_states_fails_the_job_with_it_in_a_cluster_and_locally(tmp_path, stated, reason):
    failed = pod("trainer", 0, term=3, phase="Failed", ready=False)
    failed["status"]["containerStatuses"][0]["state"]["terminated"] |= {"reason": "Error", "message": stated}
    obs = observe.summarize([failed, pod("trainer", 1)], attempt=0)
    d = status.decide(spec=spec(), generation=1, old=GRPOJobStatus(), obs=obs, now=NOW)
    failed_condition = next(c for c in d.status.conditions if c.type == "Failed")
    assert (d.status.phase, failed_condition.reason) == (Phase.FAILED, reason)
    assert stated.split(": ", 1)[1] in failed_condition.message

    body = f"import sys; print('grpo-trainer: configuration error: {stated}', file=sys.stderr); sys.exit(3)"
    cmd = PodCommand("trainer", 0, [sys.executable, "-c", body], env={}, cwd=Path.cwd(), grace_s=1.0)
    proc = PodProcess.start(cmd, tmp_path, 0)
    try:
        proc.popen.wait(timeout=30)
        gang = supervisor.gang_decision([proc], restarts=0, backoff_limit=3)
    finally:
        stop_all([proc], grace_s=1.0)
    assert (gang.outcome, gang.reason, gang.permanent) == (Outcome.FAIL, reason, True)
    plain = observe.summarize([pod("trainer", 0, term=3, phase="Failed", ready=False)], attempt=0)
    assert gang_decision(plain.verdicts, restarts=0, backoff_limit=3).reason == Reason.PERMANENT_ERROR
