"""The trainer gang's lifecycle policy: exit codes, gang restarts, backoff limit, deadline, TTL.

Pure, and the one home of these rules: the controller (`controller.status.decide`) applies
them to what a cluster's pods report, the local supervisor (`local.supervisor`) to what its
processes report, so a run gets the same verdict for the same history wherever it runs
(tests/unit/test_lifecycle.py drives one table of histories through both). docs/architecture.md
shows where this sits in the walk of a job.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from grpo_operator.api.contract import PERMANENT_EXIT_CODES
from grpo_operator.api.status import TRAINER_STATED, Reason


class VerdictKind(StrEnum):
    """What happened to one pod (or local process) of the job."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DELETED = "deleted"
    NODE_LOST = "node-lost"


_DESCRIBED = {
    VerdictKind.FAILED: "failed",
    VerdictKind.DELETED: "was deleted",
    VerdictKind.NODE_LOST: "lost its node",
    VerdictKind.SUCCEEDED: "exited 0",
}


@dataclass(frozen=True)
class Verdict:
    """Something that happened to one pod: succeeded, failed, deleted or node-lost."""

    kind: VerdictKind
    pod: str
    role: str
    attempt: int
    exit_code: int | None = None
    reason: str = ""
    created: str = ""
    """created: the pod's creationTimestamp, to drop news of a same-named job's old pods."""
    job_uid: str = ""
    """job_uid: the uid of the job that made the pod (its grpo.dev/job-uid label), if labelled."""

    @property
    def permanent(self) -> bool:
        """A failure no restart can fix (a configuration error): the job fails at once."""
        return self.kind == VerdictKind.FAILED and self.exit_code in PERMANENT_EXIT_CODES

    @property
    def stated_reason(self) -> Reason | None:
        """The reason the trainer stated for a configuration error ("<Reason>: ..." in its
        termination message or its log), if it is one of `TRAINER_STATED`."""
        found = [r for r in TRAINER_STATED if f"{r.value}: " in self.reason]
        return min(found, key=lambda r: self.reason.index(f"{r.value}: ")) if found else None

    def describe(self) -> str:
        """Which pod, which ranks, and why: what an on-call engineer reads first."""
        text = f"{self.role} pod {self.pod} {_DESCRIBED[self.kind]}"
        if self.exit_code is not None and self.kind == VerdictKind.FAILED:
            text += f" with exit code {self.exit_code}"
        return f"{text} ({self.reason})" if self.reason else text


class Outcome(StrEnum):
    """What the gang's runtime does next."""

    RUN = "Run"  # nothing decisive happened: keep going
    SUCCEED = "Succeed"
    RESTART = "Restart"  # stop every rank, start the next attempt from the last checkpoint
    FAIL = "Fail"


@dataclass(frozen=True)
class GangDecision:
    """The policy's answer; `culprit` is the verdict the messages should name."""

    outcome: Outcome
    reason: Reason | None = None
    culprit: Verdict | None = None
    permanent: bool = False  # a failure no restart can fix: the job fails at once


def gang_decision(verdicts: Sequence[Verdict], *, restarts: int, backoff_limit: int) -> GangDecision:
    """The verdict on the current attempt from its trainer pods' verdicts.

    Rank 0 exiting 0 means training finished (it exits only after the last step's save and
    export), whatever its peers do while tearing down. Otherwise any failure takes the whole
    gang down, since NCCL cannot heal a lost peer: a permanent exit code fails the job at once,
    anything else restarts the gang until `restarts` reaches `backoff_limit`.
    """
    if any(v.kind == VerdictKind.SUCCEEDED for v in verdicts):
        return GangDecision(Outcome.SUCCEED, Reason.COMPLETED)
    failures = [v for v in verdicts if v.kind != VerdictKind.SUCCEEDED]
    if not failures:
        return GangDecision(Outcome.RUN)
    permanent = next((v for v in failures if v.permanent), None)
    if permanent is not None:
        reason = permanent.stated_reason or Reason.PERMANENT_ERROR
        return GangDecision(Outcome.FAIL, reason, permanent, permanent=True)
    first = failures[0]
    if restarts >= backoff_limit:
        return GangDecision(Outcome.FAIL, Reason.BACKOFF_LIMIT_EXCEEDED, first)
    reason = Reason.NODE_LOST if first.kind == VerdictKind.NODE_LOST else Reason.TRAINER_FAILED
    return GangDecision(Outcome.RESTART, reason, first)


def seconds_left(elapsed_s: float, limit_s: int | None) -> float | None:
    """Seconds until a limit (activeDeadlineSeconds since start, ttlSecondsAfterFinished since
    completion) runs out; None without a limit, <= 0 once it has."""
    return None if limit_s is None else limit_s - elapsed_s
