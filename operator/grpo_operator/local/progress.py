"""Progress of a local run: trainer rank 0's step reports, their summary and the reward curves.

The trainer's rank 0 appends one `StepReport` (grpo_operator.api.report) per optimizer step as a
JSON line to the file named by ENV_PROGRESS_FILE; `ProgressLog` follows that file for the
supervisor and the live display, `summarize` turns it into the numbers `grpo-operator run
--summary-json` writes, and `plot_rewards` draws the PNG (training reward, and the held-out
evaluations the reports carry). After a gang restart the trainer
resumes from its last checkpoint and re-reports the steps after it: the newest report wins.
"""

import math
import os
from pathlib import Path

from pydantic import ValidationError

from grpo_operator.api.report import AttemptStart, EvalScore, StepReport


class ProgressLog:
    """Follows a JSON-lines progress file incrementally; keeps the newest record per step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.by_step: dict[int, StepReport] = {}
        self.latest: StepReport | None = None
        self.starts: list[AttemptStart] = []  # where each attempt started, in order
        self._unseen_starts: list[AttemptStart] = []

    def poll(self) -> list[StepReport]:
        """Read what was appended since the last call; returns the new records in file order."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        new = []
        for line in lines:
            try:
                rec = StepReport.model_validate_json(line)
            except ValidationError:
                start = _attempt_start(line)
                if start is not None:
                    self.starts.append(start)
                    self._unseen_starts.append(start)
                continue  # else a torn or foreign line (a library's print): it must not stop the bookkeeping
            self.by_step[rec.step] = rec
            self.latest = rec
            new.append(rec)
        return new

    def new_starts(self) -> list[AttemptStart]:
        """Attempt starts read since the last call."""
        out, self._unseen_starts = self._unseen_starts, []
        return out

    def steps(self) -> list[StepReport]:
        return [self.by_step[s] for s in sorted(self.by_step)]


def _attempt_start(line: bytes) -> AttemptStart | None:
    try:
        return AttemptStart.model_validate_json(line)
    except ValidationError:
        return None


def evaluations(records: list[StepReport]) -> list[EvalScore]:
    """Every held-out evaluation the reports carry, one per step (a re-reported step's newest), by step."""
    by_step = {e.step: e for r in records for e in r.evals}
    return [by_step[s] for s in sorted(by_step)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


EPISODE_KEYS = ("turns_mean", "tool_calls_per_episode", "tool_errors", "masked_token_fraction")


def summarize(
    records: list[StepReport], *, wall_s: float, restarts: int, starts: list[AttemptStart] | None = None
) -> dict[str, float | int | str | None]:
    """The run's summary: reward over the first/last 10% of steps, steady-state samples/s, and the
    held-out reward of the first (the baseline) and last evaluations (None without an eval set).

    samples_per_s counts the samples of steps 2..N over the time between step 1's and step
    N's reports: start-up (imports, model load, rendezvous) is left out, as throughput
    figures usually do, so the number compares with any other trainer measured the same way.
    """
    rewarded = [r.reward_mean for r in records if r.reward_mean is not None]
    k = max(1, math.ceil(len(rewarded) * 0.1))
    first, last = _mean(rewarded[:k]), _mean(rewarded[-k:])
    samples_per_s = None
    if len(records) >= 2 and records[-1].time > records[0].time:
        samples = sum(r.samples for r in records[1:])
        samples_per_s = samples / (records[-1].time - records[0].time)
    evals = evaluations(records)
    last_resumed = records[-1].resumed_from_step if records else None
    last_resumed_path = records[-1].resumed_from if records else None
    return {
        "steps": records[-1].step if records else 0,
        "reward_first": first,
        "reward_last": last,
        "eval_reward_first": evals[0].reward if evals else None,
        "eval_reward_last": evals[-1].reward if evals else None,
        "samples_per_s": samples_per_s,
        # share of completion tokens whose policy ratio was clipped, over the steps that trained
        "clip_fraction_mean": _mean(
            [r.metrics["clip_frac"] for r in records if r.metrics.get("clip_frac") is not None]
        ),
        # multi-turn episodes (spec.tools), means over the steps; None for single-turn jobs
        **{
            key: _mean([r.metrics[key] for r in records if r.metrics.get(key) is not None])
            for key in EPISODE_KEYS
        },
        # how the episodes ended and what the rewards could not judge (issue 46: never silently)
        "episodes_cut_fraction_mean": _mean(
            [
                r.metrics["episodes_cut_fraction"]
                for r in records
                if r.metrics.get("episodes_cut_fraction") is not None
            ]
        ),
        "reward_timeouts": sum(int(r.metrics.get("reward_timeouts") or 0) for r in records),
        "untrained_steps": sum(r.untrained_reason is not None for r in records),
        "wall_s": round(wall_s, 3),
        "restarts": restarts,
        # where the last attempt started (a gang restart, or a rerun); None: fresh
        "resumed_from_step": starts[-1].resumed_from_step if starts else last_resumed,
        "resumed_from": starts[-1].resumed_from if starts else last_resumed_path,
    }


def plot_rewards(records: list[StepReport], path: Path, title: str) -> Path | None:
    """Draw reward per step to a PNG (matplotlib, Agg backend), with the held-out evaluations on the
    same axes when there are any; None when nothing was rewarded."""
    points = [(r.step, r.reward_mean) for r in records if r.reward_mean is not None]
    if not points:
        return None
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps, rewards = [p[0] for p in points], [p[1] for p in points]
    ax.plot(steps, rewards, marker="o", markersize=2, linewidth=0.8, alpha=0.5, label="per step")
    window = max(1, len(points) // 20)  # a trend line: per-step rewards of small batches are noisy
    if window > 1:
        trend = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
                 for i in range(len(rewards))]  # fmt: skip
        ax.plot(steps, trend, linewidth=2, label=f"mean of last {window} steps")
    evals = evaluations(records)
    if evals:
        at = [e.step for e in evals]
        ax.plot(at, [e.reward for e in evals], marker="s", linewidth=2, label="held-out, greedy")
        sampled = [(e.step, e.pass_at_k, e.k) for e in evals if e.pass_at_k is not None]
        if sampled:
            at, best = [s for s, _, _ in sampled], [p for _, p, _ in sampled]
            ax.plot(at, best, marker="^", linewidth=1.5, label=f"held-out, pass@{sampled[-1][2]}")
    if window > 1 or evals:
        ax.legend(loc="lower right")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
