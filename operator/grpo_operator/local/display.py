"""What a person watching `grpo-operator run` sees: a live progress panel and the final summary.

Used by `grpo_operator.local.supervisor`. On a terminal the panel redraws in place (rich
Live); elsewhere (CI logs, tests) each step is one plain line, so logs stay readable.
"""

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from grpo_operator.api import signals
from grpo_operator.api.report import EvalScore, StepReport

PLAIN_LINE_EVERY_S = 1.0  # off a terminal, at most one progress line per second (plus the last step)


@dataclass
class RunState:
    """Counters the supervisor keeps and the panel shows besides the trainer's own numbers."""

    phase: str = "Starting"
    max_steps: int = 0
    gang_restarts: int = 0
    rollout_restarts: int = 0
    elapsed_s: float = 0.0


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class ProgressView:
    """Live panel on a terminal, one line per step elsewhere. Use as a context manager."""

    def __init__(self, console: Console, title: str, max_new_tokens: int | None = None) -> None:
        self.console = console
        self.title = title
        self.max_new_tokens = max_new_tokens  # spec.algorithm.maxNewTokens, named by the budget warning
        self._said: set[str] = set()  # signal warnings (api.signals) and the first untrained step, once each
        self._live: Live | None = None
        self._last: StepReport | None = None
        self._eval: EvalScore | None = None  # the newest held-out evaluation
        self._state = RunState()
        self._printed_at = -math.inf

    def __enter__(self) -> "ProgressView":
        if self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(None, None, None)
            self._live = None

    def note(self, message: str) -> None:
        """A line above the panel: restarts, phase changes, failures."""
        self.console.print(message, soft_wrap=True, markup=False)

    def update(self, state: RunState, new: list[StepReport]) -> None:
        self._state = state
        if new:
            self._last = new[-1]
        for rec in new:
            self._eval = rec.evals[-1] if rec.evals else self._eval
        for rec in new:
            if rec.checkpoint_warning:  # the trainer skipped unreadable saves at resume
                self.note(f"warning: {rec.checkpoint_warning}")
            self._say_once(rec)
        if self._live is not None:
            self._live.update(self._render())
            return
        now = time.monotonic()
        for rec in new:
            if now - self._printed_at < PLAIN_LINE_EVERY_S and rec.step < state.max_steps and not rec.evals:
                continue  # fast steps: a line a second is plenty for a log (evaluations always shown)
            self._printed_at = now
            evals = "".join(f"eval@{e.step} {_fmt(e.reward)}  " for e in rec.evals)
            turns = rec.metrics.get("turns_mean")
            episode = f"turns {_fmt(turns)}  " if turns is not None else ""
            self.console.print(
                f"step {rec.step}/{state.max_steps}  reward {_fmt(rec.reward_mean)}  {evals}{episode}"
                f"tokens/s {_fmt(rec.tokens_per_s, '.0f')}  samples/s {_fmt(rec.samples_per_s, '.1f')}  "
                f"staleness {_fmt(rec.staleness, '.0f')}  restarts {state.gang_restarts}",
                highlight=False,
                soft_wrap=True,
            )

    def _say_once(self, rec: StepReport) -> None:
        """What is wrong with the learning signal, once per run (later steps keep it in progress.jsonl)."""
        found = signals.warnings(
            reward_timeouts=rec.reward_timeouts_total,
            cut_fraction=rec.metrics.get("episodes_cut_fraction"),
            max_new_tokens=self.max_new_tokens,
        )
        lines = [(reason, f"warning: {message}") for reason, message in found]
        if rec.untrained_reason:
            lines.append(
                ("untrained", f"note: step {rec.step} trained on no completion: {rec.untrained_reason}")
            )
        for reason, line in lines:
            if reason not in self._said:
                self._said.add(reason)
                self.note(line)

    def _render(self) -> Table:
        s, r = self._state, self._last
        table = Table(title=f"{self.title} — {s.phase}", show_header=True, expand=False)
        # Narrow headers: the panel must fit an 80-column terminal without wrapping cells.
        turns = r.metrics.get("turns_mean") if r else None  # multi-turn jobs (tools, an environment)
        columns = ("step", "reward", "eval", *(("turns",) if turns is not None else ()), "tok/s", "samples/s",
                   "stale", "weights", "restarts", "elapsed")  # fmt: skip
        for col in columns:
            table.add_column(col, justify="right", no_wrap=True)
        table.add_row(
            f"{r.step if r else 0}/{s.max_steps}",
            _fmt(r.reward_mean if r else None),
            _fmt(self._eval.reward if self._eval else None),
            *((_fmt(turns),) if turns is not None else ()),
            _fmt(r.tokens_per_s if r else None, ".0f"),
            _fmt(r.samples_per_s if r else None, ".1f"),
            _fmt(r.staleness if r else None, ".0f"),
            "-" if r is None or r.weight_version is None else str(r.weight_version),
            f"{s.gang_restarts}" + (f" +{s.rollout_restarts} rollout" if s.rollout_restarts else ""),
            f"{s.elapsed_s:.0f}s",
        )
        return table


def summary_table(title: str, summary: dict[str, Any], extras: dict[str, str]) -> Table:
    """The end-of-run table: the summary numbers plus where the artefacts are."""
    table = Table(title=title, show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in summary.items():
        table.add_row(key, _fmt(value) if isinstance(value, float) else str(value))
    for key, value in extras.items():
        table.add_row(key, value)
    return table


def print_failure(console: Console, reason: str, tails: dict[str, tuple[Path, str]]) -> None:
    """The reason, then each failing pod's log tail under a header naming the pod and its log file."""
    for pod, (log_path, tail) in tails.items():
        console.rule(f"{pod}: last lines of {log_path}")
        console.print(tail, markup=False, highlight=False, soft_wrap=True)
    console.print("[bold red]failed:[/] ", end="")
    console.print(reason, markup=False, highlight=False, soft_wrap=True)
