"""Progress reports of trainer rank 0: one JSON line per step, and the GRPOJob status in a cluster.

Called by the training loop after every optimizer step (`step_report` builds the report, the
API's `StepReport`). Lines go to the file named by ENV_PROGRESS_FILE (the local runtime follows
it) or to stdout. Inside a Kubernetes pod the same report is patched into the GRPOJob's
`status.progress` from a background thread that only ever holds the newest one: a slow or
failing API server costs a log line, never a training step. The pod's ServiceAccount needs
`patch` on `grpojobs/status`.
"""

import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, TextIO

from grpo_operator.api import signals
from grpo_operator.api.contract import RunContract
from grpo_operator.api.job import GROUP, PLURAL, VERSION
from grpo_operator.api.report import ENV_PROGRESS_FILE, AttemptStart, EvalScore, StepReport

from grpo_trainer import exporter, tracking
from grpo_trainer.batch import Rollouts
from grpo_trainer.checkpoint import TrainState
from grpo_trainer.moe import autoselect

log = logging.getLogger(__name__)


class StatusPatcher:
    """Latest-wins, best-effort patcher of `status.progress` (daemon thread)."""

    def __init__(self, namespace: str, name: str, api: Any = None) -> None:
        """`api`: a kubernetes CustomObjectsApi; by default one with the pod's in-cluster identity."""
        if api is None:
            from kubernetes import client, config  # only in a cluster: keeps local start-up lean

            config.load_incluster_config()
            api = client.CustomObjectsApi()
        self._api = api
        self._namespace, self._name = namespace, name
        self._pending: dict[str, Any] | None = None
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="status-patcher", daemon=True).start()

    def submit(self, progress: dict[str, Any]) -> None:
        with self._cv:
            self._pending = progress
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    self._cv.wait()
                body, self._pending = {"status": {"progress": self._pending}}, None
            try:
                self._api.patch_namespaced_custom_object_status(
                    GROUP, VERSION, self._namespace, PLURAL, self._name, body, _request_timeout=10
                )
            except Exception as e:  # best effort by design: report, never raise into training
                log.warning("could not patch %s/%s status.progress: %s", self._namespace, self._name, e)
                time.sleep(5)


class ProgressReporter:
    """Writes rank 0's per-step reports; also the GRPOJob status when running in a cluster, the
    Prometheus exporter on `trainer.metricsPort` and the experiment tracker of `spec.tracking`.

    Each report gets the share of the last WAIT_WINDOW steps' wall time spent waiting for
    rollouts: the signal `rollout.autoscaling` follows (one step alone is too noisy). Exporter and
    tracker are observers: when they fail the step goes on, with a warning."""

    WAIT_WINDOW = 10

    def __init__(self, contract: RunContract, path: str | None, in_cluster: bool) -> None:
        self._out: TextIO = open(path, "a") if path else sys.stdout  # noqa: SIM115 - lives as long as training
        self._patcher: StatusPatcher | None = None
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.WAIT_WINDOW)  # (rollout_s, step_s)
        self._max_new_tokens = contract.spec.algorithm.max_new_tokens
        self._reward_timeouts = 0  # this attempt's, summed over its steps
        self._said: set[str] = set()  # the signal warnings logged (api.signals), once each
        if in_cluster:
            try:
                self._patcher = StatusPatcher(contract.namespace, contract.job_name)
            except Exception as e:  # no client, no ServiceAccount token: the JSON lines still flow
                log.warning("GRPOJob status progress disabled: %s", e)
        self.exporter: exporter.MetricsExporter | None = None
        if contract.trainer.metrics_port:
            try:
                self.exporter = exporter.MetricsExporter(contract.trainer.metrics_port)
            except OSError as e:  # the port is taken: training matters more than its scrape
                log.warning("trainer /metrics disabled: %s", e)
        self.tracker: tracking.Tracker | None = None
        try:
            self.tracker = tracking.open_tracker(contract)
            if self.tracker is not None:
                self.tracker.log_params(tracking.flat_params(contract.spec.wire()))
        except Exception as e:  # unreachable server, missing extra, bad credentials
            log.warning("experiment tracking (%s) disabled: %s", contract.spec.tracking, e)
            self.tracker = None

    @classmethod
    def from_env(cls, contract: RunContract) -> "ProgressReporter":
        path = os.environ.get(ENV_PROGRESS_FILE)
        return cls(contract, path, in_cluster="KUBERNETES_SERVICE_HOST" in os.environ)

    def attempt_started(self, resumed_from_step: int | None, resumed_from: str | None) -> None:
        """Say where this attempt starts and which EP backend `auto` chose (and why), before its
        first step: in the log, the progress file (the local runtime prints it) and, in a cluster,
        status.progress (the operator announces the choice with an Event)."""
        selection = autoselect.last_selection()
        start = AttemptStart(
            resumed_from_step=resumed_from_step,
            resumed_from=resumed_from,
            ep_backend=selection.backend if selection else None,
            ep_candidates=selection.summary() if selection else {},
            time=time.time(),
        )
        log.info("attempt %s", start.describe())
        self._out.write(start.model_dump_json() + "\n")
        self._out.flush()
        if self._patcher is not None:
            self._patcher.submit(start.to_progress_patch())

    def report(self, report: StepReport) -> None:
        self._recent.append((report.rollout_s, report.step_s))
        total = sum(step for _, step in self._recent)
        if total > 0:
            waited = min(1.0, sum(wait for wait, _ in self._recent) / total)
            report = report.model_copy(update={"rollout_wait_fraction": waited})
        if report.metrics.get("reward_timeouts") is not None:
            self._reward_timeouts += int(report.metrics["reward_timeouts"] or 0)
            report = report.model_copy(update={"reward_timeouts_total": self._reward_timeouts})
        self._warn(report)
        self._out.write(report.model_dump_json() + "\n")
        self._out.flush()
        if self._patcher is not None:
            self._patcher.submit(report.to_progress().wire())
        if self.exporter is not None:
            self.exporter.report(report)
        if self.tracker is not None:
            try:
                tracking.log_report(self.tracker, report)
            except Exception as e:  # a tracking server's hiccup costs a log line, never a step
                log.warning("experiment tracking: step %d not logged: %s", report.step, e)

    def _warn(self, report: StepReport) -> None:
        """The signal warnings this report shows, each logged once (the operator posts them as Events)."""
        if report.untrained_reason:
            log.info("step %d trained on no completion: %s", report.step, report.untrained_reason)
        found = signals.warnings(
            reward_timeouts=report.reward_timeouts_total,
            cut_fraction=report.metrics.get("episodes_cut_fraction"),
            max_new_tokens=self._max_new_tokens,
        )
        for reason, message in found:
            if reason not in self._said:
                self._said.add(reason)
                log.warning("step %d: %s", report.step, message)

    def close(self) -> None:
        if self._out is not sys.stdout:
            self._out.close()
        if self.exporter is not None:
            self.exporter.close()
        if self.tracker is not None:
            try:
                self.tracker.close()
            except Exception as e:
                log.warning("experiment tracking: closing the run failed: %s", e)


@dataclass(frozen=True)
class StepSeconds:
    """Where a step's wall time went, on rank 0."""

    step: float
    rollout: float  # waiting for generations not hidden behind training
    train: float
    push: float
    ep_all_to_all: float | None  # dispatch and combine, inside `train`; None without EP


def step_report(
    run_state: TrainState,
    rollouts: Rollouts,
    *,
    max_steps: int,
    staleness: int,
    seconds: StepSeconds,
    metrics: dict[str, float | None],
    checkpoint: tuple[str, int] | None,
    untrained_reason: str | None = None,
    resumed_from_step: int | None = None,
    resumed_from: str | None = None,
    checkpoint_warning: str | None = None,
    evals: list[EvalScore] | None = None,
) -> StepReport:
    """Rank 0's report of the step just finished."""
    tokens = sum(map(len, rollouts.prompt_tokens)) + rollouts.completion_tokens_total()
    selection = autoselect.last_selection()  # the gang-wide EP choice, when epBackend is auto
    wall = seconds.step
    return StepReport(
        step=run_state.step,
        max_steps=max_steps,
        reward_mean=sum(rollouts.rewards) / len(rollouts),
        tokens_per_s=tokens / wall if wall > 0 else None,
        samples_per_s=len(rollouts) / wall if wall > 0 else None,
        samples=len(rollouts),
        trained_samples=None
        if metrics.get("trained_samples") is None
        else int(metrics["trained_samples"] or 0),
        untrained_reason=untrained_reason,
        staleness=staleness,
        weight_version=run_state.version,
        position=run_state.position,
        step_s=wall,
        rollout_s=seconds.rollout,
        train_s=seconds.train,
        push_s=seconds.push,
        ep_all_to_all_s=seconds.ep_all_to_all,
        ep_backend=selection.backend if selection else None,
        ep_candidates=selection.summary() if selection else {},
        time=time.time(),
        last_checkpoint=checkpoint[0] if checkpoint else None,
        last_checkpoint_step=checkpoint[1] if checkpoint else None,
        resumed_from_step=resumed_from_step,
        resumed_from=resumed_from,
        checkpoint_warning=checkpoint_warning,
        metrics=metrics,
        evals=evals or [],
    )
