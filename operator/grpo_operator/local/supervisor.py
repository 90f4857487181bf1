"""The local runtime's control loop: what the operator and the kubelet do, for local processes.

Called by `grpo-operator run` (`grpo_operator.cli.run`). It starts the reward model servers
(spec.reward.model) and then the rollout servers, waits for their health endpoints, starts the
trainer gang and follows rank 0's progress.
Failure handling is the cluster's: a dead rollout or reward model server is replaced alone (the trainer
re-sends its prompts elsewhere); what a trainer process's exit means (restart the gang from
its last checkpoint, fail for good, or done) is decided by `grpo_operator.lifecycle`, the
policy the controller applies to pods. An edit of the job file's `spec.rollout.replicas` during
the run adds or removes rollout servers, as `kubectl scale grpo/NAME` does in a cluster
(`grpo_operator.local.scaling`); the trainer follows the rewritten contract file. Ctrl-C or
SIGTERM stops every process group before the runtime exits.
"""

import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from grpo_operator import lifecycle
from grpo_operator.api.report import StepReport
from grpo_operator.api.status import Phase
from grpo_operator.lifecycle import GangDecision, Outcome, Verdict, VerdictKind
from grpo_operator.local import scaling
from grpo_operator.local.display import ProgressView, RunState, print_failure
from grpo_operator.local.plan import LocalPlan, free_port
from grpo_operator.local.procs import PodProcess, stop_all
from grpo_operator.local.progress import ProgressLog, summarize
from grpo_operator.render import names

ROLLOUT_RESTART_LIMIT = 5  # per server; a server that keeps dying is a bug, not bad luck
POLL_S = 0.2
SCALE_POLL_S = 1.0  # how often the job file is checked for a new rollout replica count
INTERRUPTED = "Interrupted"  # a local run's own end besides the job phases: stopped by Ctrl-C


class RunFailed(Exception):
    """The run ended without finishing; `reason` says which pod, which rank, and why."""

    def __init__(self, reason: str, tails: dict[str, tuple[Path, str]] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.tails = tails or {}


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the runtime; the run was stopped on request."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class RunResult:
    summary: dict[str, Any]
    records: list[StepReport]
    state: RunState
    failure: RunFailed | None = None
    interrupted: Interrupted | None = None
    extras: dict[str, str] = field(default_factory=dict)


def _exit_text(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class Supervisor:
    """Runs one `LocalPlan` to completion, failure or interruption."""

    def __init__(
        self,
        plan: LocalPlan,
        console: Console,
        *,
        health_timeout_s: float = 300.0,
        job_file: Path | None = None,
    ) -> None:
        """`job_file`: followed for `spec.rollout.replicas` edits during the run (None: fixed)."""
        self.plan = plan
        self.console = console
        self.health_timeout_s = health_timeout_s
        self.logs = plan.workdir / "logs"
        self.progress = ProgressLog(plan.progress_path)
        self.state = RunState(max_steps=plan.job.spec.algorithm.max_steps)
        self.rollout: list[PodProcess] = []
        self.trainer: list[PodProcess] = []
        self.reward: list[PodProcess] = []
        self._rollout_restarts = [0] * len(plan.rollout)
        self._reward_restarts = [0] * len(plan.reward)
        self._signal: int | None = None
        self._endpoints = list(plan.contract.rollout.endpoints)  # what the contract file lists now
        self._leaving: list[tuple[PodProcess, float]] = []  # removed servers draining, until when
        self._watch = scaling.JobFileWatch(job_file, len(plan.rollout)) if job_file else None
        self._next_scale_check = 0.0

    def run(self) -> RunResult:
        """Run the job; always returns with every process group stopped."""
        start = time.monotonic()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        failure: RunFailed | None = None
        interrupted: Interrupted | None = None
        view = ProgressView(self.console, self.plan.name, self.plan.job.spec.algorithm.max_new_tokens)
        try:
            with view:
                try:
                    self._run(view, start)
                except RunFailed as e:
                    failure = e
                except Interrupted as e:
                    interrupted = e
                finally:
                    # Trainer first: it checkpoints on SIGTERM and may still push weights, which
                    # draining rollout servers would refuse; then the servers drain an idle queue.
                    stop_all(self.trainer)
                    stop_all(self.rollout + [p for p, _ in self._leaving])
                    stop_all(self.reward)  # last: draining rollout servers may still score
                    ended = Phase.FAILED if failure else Phase.SUCCEEDED
                    self.state.phase = INTERRUPTED if interrupted else ended
                    self.state.elapsed_s = time.monotonic() - start
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        records = self.progress.steps()
        summary = summarize(
            records,
            wall_s=time.monotonic() - start,
            restarts=self.state.gang_restarts,
            starts=self.progress.starts,
        )
        if failure is not None:
            print_failure(self.console, failure.reason, failure.tails)
        return RunResult(summary, records, self.state, failure, interrupted)

    def _on_signal(self, signum: int, _frame: object) -> None:
        """First signal: stop gracefully (pods get their grace period). Second: kill them now."""
        if self._signal is not None:
            for proc in self.trainer + self.rollout + self.reward + [p for p, _ in self._leaving]:
                proc.signal_group(signal.SIGKILL)
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal is not None:
            raise Interrupted(self._signal)

    def _run(self, view: ProgressView, start: float) -> None:
        if not self.plan.rollout:
            raise RunFailed("rollout.replicas is 0: no server would generate completions locally")
        self.state.phase = Phase.STARTING
        if self.plan.reward:  # before the rollout servers, which score there from their first batch
            self.reward = [PodProcess.start(c, self.logs, 0) for c in self.plan.reward]
            reward = self.plan.contract.reward
            self._wait_healthy(view, start, self.reward, reward.endpoints if reward else [], "reward model")
        self.rollout = [PodProcess.start(c, self.logs, 0) for c in self.plan.rollout]
        self._wait_healthy(view, start, self.rollout, self.plan.contract.rollout.endpoints, "rollout")
        self.trainer = self._start_gang(attempt=0)
        self.state.phase = Phase.RUNNING
        deadline = self.plan.job.spec.run_policy.active_deadline_seconds
        while True:
            self._check_signal()
            self.state.elapsed_s = time.monotonic() - start
            left = lifecycle.seconds_left(self.state.elapsed_s, deadline)
            if left is not None and left <= 0:
                raise RunFailed(f"activeDeadlineSeconds ({deadline}) exceeded at step {self._step()}")
            self._replace_dead(view, self.rollout, self._rollout_restarts)
            self._replace_dead(view, self.reward, self._reward_restarts)
            self._scale_rollout(view)
            view.update(self.state, self.progress.poll())
            for begun in self.progress.new_starts():
                view.note(f"trainer attempt {self.state.gang_restarts}: {begun.describe()}")
            if self._gang_finished(view):
                view.update(self.state, self.progress.poll())
                return
            time.sleep(POLL_S)

    def _step(self) -> int:
        return self.progress.latest.step if self.progress.latest else 0

    def _wait_healthy(
        self, view: ProgressView, start: float, procs: list[PodProcess], endpoints: list[str], what: str
    ) -> None:
        """Block until every server of `procs` (rollout or reward model) answers its health probe with 200."""
        pending = set(range(len(procs)))
        deadline = time.monotonic() + self.health_timeout_s
        while pending:
            self._check_signal()
            self.state.elapsed_s = time.monotonic() - start
            view.update(self.state, [])
            for i in sorted(pending):
                proc = procs[i]
                if (code := proc.poll()) is not None:
                    name = proc.command.name
                    what = f"{_exit_text(code)} before it became healthy: {proc.why()}"
                    raise RunFailed(f"{name} {what}", {name: (proc.log_path, proc.log_tail())})
                if self._healthy(endpoints[i]):
                    pending.discard(i)
            if time.monotonic() > deadline:
                names = ", ".join(procs[i].command.name for i in sorted(pending))
                raise RunFailed(f"{what} servers not healthy after {self.health_timeout_s:.0f}s: {names}")
            time.sleep(POLL_S)

    def _healthy(self, endpoint: str) -> bool:
        try:
            with urllib.request.urlopen(f"{endpoint}{self.plan.health_path}", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _start_gang(self, attempt: int) -> list[PodProcess]:
        return [PodProcess.start(c, self.logs, attempt) for c in self.plan.trainer]

    def _replace_dead(self, view: ProgressView, servers: list[PodProcess], restarts: list[int]) -> None:
        """A rollout or reward model server that died is replaced alone, as its StatefulSet would."""
        for i, proc in enumerate(servers):
            code = proc.poll()
            if code is None:
                continue
            name = proc.command.name
            if restarts[i] >= ROLLOUT_RESTART_LIMIT:
                what = f"{_exit_text(code)} after {ROLLOUT_RESTART_LIMIT} restarts: {proc.why()}"
                raise RunFailed(f"{name} {what}", {name: (proc.log_path, proc.log_tail())})
            stop_all([proc], grace_s=2.0)  # whatever it forked goes with it
            restarts[i] += 1
            self.state.rollout_restarts += proc.command.role == names.ROLE_ROLLOUT
            view.note(f"{name} {_exit_text(code)} at step {self._step()}; restarting it alone")
            servers[i] = PodProcess.start(proc.command, self.logs, restarts[i])

    def _scale_rollout(self, view: ProgressView) -> None:
        """Follow `spec.rollout.replicas` in the job file: new servers start at the next indices
        (listed in the contract first: a server reads its port there), removed ones (highest index
        first) drain within their grace period without blocking this loop."""
        self._reap_leaving()
        if self._watch is None or time.monotonic() < self._next_scale_check:
            return
        self._next_scale_check = time.monotonic() + SCALE_POLL_S
        replicas, problem = self._watch.poll()
        if problem:
            view.note(problem)
        if replicas is None or replicas == len(self.rollout):
            return
        if replicas < 1:
            view.note("rollout.replicas below 1 ignored locally: no server would generate completions")
            return
        old = len(self.rollout)
        template = self.plan.rollout[0]
        path = scaling.contract_path(template)
        if replicas > old:
            self._endpoints += [f"http://127.0.0.1:{free_port()}" for _ in range(replicas - old)]
            scaling.write_contract(path, scaling.with_endpoints(self.plan.contract, self._endpoints))
            for index in range(old, replicas):
                self.rollout.append(PodProcess.start(scaling.rollout_pod(template, index), self.logs, 0))
                self._rollout_restarts.append(0)
        else:
            leaving = self.rollout[replicas:]
            del self.rollout[replicas:], self._rollout_restarts[replicas:], self._endpoints[replicas:]
            scaling.write_contract(path, scaling.with_endpoints(self.plan.contract, self._endpoints))
            for proc in leaving:
                proc.signal_group(signal.SIGTERM)
                self._leaving.append((proc, time.monotonic() + proc.command.grace_s))
        view.note(f"rollout scaled from {old} to {replicas} server(s) at step {self._step()}")

    def _reap_leaving(self) -> None:
        """Removed servers: gone once their group exits; SIGKILLed past their grace period."""
        still = []
        for proc, until in self._leaving:
            if not proc.group_alive():
                continue
            if time.monotonic() > until:
                proc.signal_group(signal.SIGKILL)
            still.append((proc, until))
        self._leaving = still

    def _gang_finished(self, view: ProgressView) -> bool:
        """True when training finished; restarts the gang or raises as `lifecycle` decides."""
        limit = self.plan.job.spec.run_policy.backoff_limit
        gang = gang_decision(self.trainer, restarts=self.state.gang_restarts, backoff_limit=limit)
        if gang.outcome in (Outcome.RUN, Outcome.SUCCEED):
            return gang.outcome == Outcome.SUCCEED
        culprit = next(p for p in self.trainer if gang.culprit and p.command.name == gang.culprit.pod)
        code = culprit.poll()
        assert code is not None
        what = f"{culprit.command.name} {_exit_text(code)} at step {self._step()}: {culprit.why()}"
        failed = [p for p in self.trainer if p.poll() not in (None, 0)]
        tails = {p.command.name: (p.log_path, p.log_tail()) for p in failed}
        if gang.permanent:
            raise RunFailed(f"permanent error ({gang.reason}), not retried: {what}", tails)
        if gang.outcome == Outcome.FAIL:
            raise RunFailed(f"backoffLimit ({limit}) exceeded: {what}", tails)
        self.state.phase = Phase.RESTARTING
        stop_all(self.trainer)
        self.state.gang_restarts += 1
        n = self.state.gang_restarts
        view.note(f"{what}\nrestarting the trainer gang from its last checkpoint ({n}/{limit})")
        self.trainer = self._start_gang(attempt=self.state.gang_restarts)
        self.state.phase = Phase.RUNNING
        return False


def gang_decision(trainer: list[PodProcess], *, restarts: int, backoff_limit: int) -> GangDecision:
    """The lifecycle policy applied to the gang's processes, as the controller applies it to pods."""
    verdicts = process_verdicts(trainer, attempt=restarts)
    return lifecycle.gang_decision(verdicts, restarts=restarts, backoff_limit=backoff_limit)


def process_verdicts(trainer: list[PodProcess], *, attempt: int) -> list[Verdict]:
    """What a kubelet and the operator's pod watch would say of these trainer "pods": pod 0
    exiting 0 is success, any other exit code a failure (a signal as 128 + n, as a kubelet
    reports it), a running process nothing."""
    out = []
    for index, proc in enumerate(trainer):
        code = proc.poll()
        if code is None or (code == 0 and index > 0):
            continue
        base = {"pod": proc.command.name, "role": names.ROLE_TRAINER, "attempt": attempt}
        if code == 0:
            out.append(Verdict(VerdictKind.SUCCEEDED, **base, exit_code=0))
        else:
            exit_code = 128 - code if code < 0 else code
            out.append(Verdict(VerdictKind.FAILED, **base, exit_code=exit_code, reason=proc.why()))
    return out
