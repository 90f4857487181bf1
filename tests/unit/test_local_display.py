"""What `grpo-operator run` prints (grpo_operator.local.display): the held-out evaluations appear
in the live table and, off a terminal, on the step line that carries them, never skipped by the
one-line-a-second throttle."""

import io

from grpo_operator.api.report import EvalScore, StepReport
from grpo_operator.local.display import ProgressView, RunState
from rich.console import Console


def report(step: int, evals: list[EvalScore]) -> StepReport:
    return StepReport(
        step=step, max_steps=10, reward_mean=0.5, tokens_per_s=1.0, samples_per_s=1.0, samples=4,
        staleness=0, weight_version=step, position=4 * step, step_s=0.1, rollout_s=0.0, train_s=0.1,
        push_s=0.0, time=1.7e9 + step, evals=evals,
    )  # fmt: skip


def test_plain_lines_show_every_evaluation_and_the_table_the_newest() -> None:
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    baseline = EvalScore(step=0, reward=0.25, k=0, prompts=20, seconds=1.0)
    later = EvalScore(step=3, reward=0.75, k=0, prompts=20, seconds=1.0)
    with ProgressView(console, "job") as view:
        state = RunState(phase="Running", max_steps=10)
        view.update(state, [report(1, [baseline]), report(2, []), report(3, [later])])
        table = io.StringIO()
        Console(file=table, width=200).print(view._render())
    lines = out.getvalue().splitlines()
    assert [line for line in lines if "eval@" in line] == [
        line for line in lines if line.startswith(("step 1/", "step 3/"))
    ]
    assert "eval@0 0.250" in out.getvalue() and "eval@3 0.750" in out.getvalue()
    assert "eval" in table.getvalue() and "0.750" in table.getvalue()


def test_a_multi_turn_job_shows_its_turns_per_episode() -> None:
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    with ProgressView(console, "job") as view:
        state = RunState(phase="Running", max_steps=10)
        multi = report(1, []).model_copy(update={"metrics": {"turns_mean": 1.75}})
        view.update(state, [multi])
        table = io.StringIO()
        Console(file=table, width=200).print(view._render())
        assert "turns 1.750" in out.getvalue() and "turns" in table.getvalue() and "1.750" in table.getvalue()
        view.update(state, [report(2, [])])  # single-turn: no turns column
        table = io.StringIO()
        Console(file=table, width=200).print(view._render())
        assert "turns" not in table.getvalue()
