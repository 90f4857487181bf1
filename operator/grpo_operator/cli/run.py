"""`grpo-operator run FILE`: run a GRPOJob on this machine as local processes.

Dispatched by `grpo_operator.cli`. Renders the job's pods with the operator's renderer,
runs them under `grpo_operator.local.supervisor`, then prints a summary table, draws the
reward curve and optionally writes the summary as JSON (what tests and benchmarks read).
"""

import argparse
import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from grpo_operator.local.display import summary_table
from grpo_operator.local.plan import PlanError, build_plan
from grpo_operator.local.progress import plot_rewards
from grpo_operator.local.supervisor import Supervisor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", type=Path, help="GRPOJob manifest (YAML); relative paths in it are read from its folder"
    )
    parser.add_argument(
        "--summary-json",
        type=Path,
        metavar="PATH",
        help='write {"steps", "reward_first", "reward_last", "samples_per_s", "wall_s", "restarts", '
        '"resumed_from_step", "resumed_from", "episodes_cut_fraction_mean", "reward_timeouts", '
        '"untrained_steps", and with spec.tools or spec.environment "turns_mean", '
        '"tool_calls_per_episode", "tool_errors", "masked_token_fraction"} here',
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        metavar="DIR",
        help="where the contract, logs, progress, checkpoints (unless the job sets them) and plot go "
        "(default: a new temporary folder)",
    )
    add_pvc_argument(parser)
    parser.add_argument(
        "--health-timeout", type=float, default=300.0, metavar="S", help="seconds to wait for rollout servers"
    )


def add_pvc_argument(parser: argparse.ArgumentParser, when: str = "") -> None:
    """`--pvc CLAIM=DIR` (repeatable), read by `claims`: the commands that resolve a job's paths here."""
    parser.add_argument(
        "--pvc",
        action="append",
        default=[],
        metavar="CLAIM=DIR",
        help=f"{when}a local folder standing in for a PersistentVolumeClaim: pvc://CLAIM/path reads "
        "DIR/path (repeatable)",
    )


def claims(pairs: list[str]) -> dict[str, Path]:
    """`--pvc CLAIM=DIR` values as {claim: folder}; PlanError on a malformed one."""
    out = {}
    for pair in pairs:
        claim, sep, folder = pair.partition("=")
        if not sep or not claim or not folder:
            raise PlanError(f"--pvc {pair!r}: expected CLAIM=DIR")
        out[claim] = Path(folder)
    return out


def run(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"grpo-{args.file.stem}-"))
    try:
        plan = build_plan(args.file, workdir, pvc=claims(args.pvc))
    except PlanError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 2
    pods = f"{len(plan.rollout)} rollout server(s), {len(plan.trainer)} trainer pod(s)"
    if plan.reward:
        pods = f"{len(plan.reward)} reward model server(s), {pods}"
    console.print(f"{plan.name}: {pods}; logs in {workdir}")
    result = Supervisor(plan, console, health_timeout_s=args.health_timeout, job_file=args.file).run()

    extras = {"workdir": str(workdir), "logs": str(workdir / "logs")}
    try:
        png = plot_rewards(result.records, workdir / "reward.png", f"{plan.name}: reward per step")
        if png is not None:
            extras["reward curve"] = str(png)
    except ImportError:
        extras["reward curve"] = "not drawn: matplotlib is not installed"
    console.print(summary_table(f"{plan.name}: summary", result.summary, extras))
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        args.summary_json.write_text(json.dumps(result.summary, indent=2) + "\n")
    if result.interrupted is not None:
        console.print(f"stopped by {result.interrupted}; every process was stopped")
        return 128 + result.interrupted.signum
    return 1 if result.failure is not None else 0
