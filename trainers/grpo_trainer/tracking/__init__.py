"""Experiment tracking of trainer rank 0 behind one small interface, `Tracker`.

`progress.ProgressReporter` opens the tracker the spec names (`spec.tracking`), logs the spec as
the run's parameters once, and every step report as metrics. Each backend is one small module
that imports its library only when chosen, so each stays an optional extra (`pip install
grpo-operator[mlflow]`, `[tensorboard]`, `[wandb]`); adding one is a module plus a line in
BACKENDS. One job is one run, named after the job, in the spec's experiment (default: the job).
"""

import json
from collections.abc import Callable
from typing import Any, Protocol

from grpo_operator.api.contract import RunContract
from grpo_operator.api.report import StepReport
from grpo_operator.api.tracking import TrackingBackend

from grpo_trainer import exporter
from grpo_trainer.tracking import mlflow_tracker, tensorboard_tracker, wandb_tracker


class Tracker(Protocol):
    def log_params(self, params: dict[str, str]) -> None:
        """The run's parameters, once, as flat dotted names."""

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        """One step's numbers."""

    def close(self) -> None:
        """Flush and mark the run finished."""


# backend -> factory(uri, experiment, run_name)
BACKENDS: dict[str, Callable[[str | None, str, str], Tracker]] = {
    TrackingBackend.MLFLOW: mlflow_tracker.MlflowTracker,
    TrackingBackend.TENSORBOARD: tensorboard_tracker.TensorBoardTracker,
    TrackingBackend.WANDB: wandb_tracker.WandbTracker,
}


def open_tracker(contract: RunContract) -> Tracker | None:
    """The tracker of `contract.spec.tracking`; None when the job tracks nothing."""
    spec = contract.spec.tracking
    if spec is None:
        return None
    return BACKENDS[spec.backend](spec.uri, spec.experiment or contract.job_name, contract.job_name)


def flat_params(tree: Any, prefix: str = "") -> dict[str, str]:
    """A nested spec as {"algorithm.learningRate": "1e-06", ...}; lists stay whole, as JSON."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(flat_params(value, f"{prefix}{key}."))
        return out
    value = tree if isinstance(tree, str) else json.dumps(tree)
    return {prefix.rstrip("."): value}


def log_report(tracker: Tracker, report: StepReport) -> None:
    """One report: each held-out evaluation it carries (eval_reward, eval_pass_at_k...) at the step
    it scored, so train and eval curves share one axis; then the loss-side metrics and the report's
    numeric fields (reward_mean, tokens_per_s, the seconds split...) at the report's step, the
    fields winning a name clash. Oldest step first: W&B drops a step below one already logged."""
    for score in report.evals:
        tracker.log_metrics(exporter.eval_values(score), step=score.step)
    tracker.log_metrics({**exporter.step_metrics(report), **exporter.report_values(report)}, step=report.step)
