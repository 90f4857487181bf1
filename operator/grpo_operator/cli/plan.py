"""`grpo-operator plan FILE [--model-config config.json] [--reward-model-config config.json] [--json]`:
will the job fit in GPU memory?

Prints, per GPU, the trainer's parameters, gradients, optimizer state, activations, logits,
weight-sync buffers and reference model, and the rollout's weights and KV-cache room, each with its
formula, against the GPU memory of the roles' instance types (`grpo_operator.instance_types`). The
arithmetic is `grpo_operator.memory_plan`; docs/memory-plan.md explains it. The model's config.json
comes from `--model-config` or from `spec.model.path` when that is a local directory. With
spec.reward.model, a reward role row too: one reward model server's weights, activations and runtime
(and a judge's KV cache) on its one GPU, from `--reward-model-config` or the reward model's local
directory (left out, with a note, when neither is at hand). Exit status 0
when everything fits (or there is no fixed budget), 1 when a role does not fit, 2 on bad input.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from grpo_operator import instance_types, memory_plan
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.memory_plan import GIB, RolePlan

AC_CHOICES = {"auto": None, "on": True, "off": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="a GRPOJob manifest (the first GRPOJob of the file)")
    parser.add_argument(
        "--model-config", type=Path, help="the model's config.json (default: MODEL_PATH/config.json)"
    )
    parser.add_argument(
        "--reward-model-config",
        type=Path,
        help="spec.reward.model's config.json (default: its path's config.json, when a local directory)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--sharding",
        choices=[str(s) for s in memory_plan.Sharding],
        help="plan the trainer with this mode (default: the spec's trainer.sharding)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=memory_plan.DEFAULT_PROMPT_TOKENS,
        help=f"longest prompt in tokens (default {memory_plan.DEFAULT_PROMPT_TOKENS})",
    )
    parser.add_argument("--activation-checkpointing", choices=list(AC_CHOICES), default="auto")
    parser.add_argument("--instance-types", help="YAML/JSON file of instance-type rows merged over the table")


def gpu_bytes(table: instance_types.InstanceTable, name: str | None) -> int | None:
    return table.get(name).gpu_memory_bytes if name else None


def make_plan(
    spec: GRPOJobSpec, config: dict[str, Any], table: instance_types.InstanceTable, **options: Any
) -> memory_plan.Plan:
    return memory_plan.plan_job(
        config,
        spec,
        trainer_gpu_bytes=gpu_bytes(table, spec.trainer.instance_type),
        rollout_gpu_bytes=gpu_bytes(table, spec.rollout.instance_type),
        **options,
    )


def _first_job(path: Path) -> GRPOJob:
    for raw in yaml.safe_load_all(path.read_text()):
        if isinstance(raw, dict) and raw.get("kind") == "GRPOJob":
            return GRPOJob.model_validate(raw)
    raise ValueError(f"{path}: no GRPOJob document")


def run(args: argparse.Namespace) -> int:
    try:
        job = _first_job(args.file)
        table = instance_types.load(args.instance_types)
        source = args.model_config or memory_plan.find_config(job.spec.model.path, args.file.parent)
        if source is None:
            print(
                f"{args.file}: model {job.spec.model.path} is not a local directory with a config.json: "
                "pass --model-config config.json",
                file=sys.stderr,
            )
            return 2
        config = json.loads(source.read_text())
        plan = make_plan(
            job.spec,
            config,
            table,
            sharding=args.sharding,
            prompt_tokens=args.prompt_tokens,
            activation_checkpointing=AC_CHOICES[args.activation_checkpointing],
        )
        plan = with_reward(plan, job.spec, table, args)
    except (OSError, ValueError, ValidationError, KeyError) as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 2
    hints = [] if plan.trainer.fits is not False else fitting_modes(job.spec, config, table, args)
    if args.json:
        out = plan.to_json()
        out["trainer"]["fits_with_sharding"] = hints
        print(json.dumps(out, indent=2))
    else:
        show(plan, str(source), hints)
    fits = (plan.trainer.fits, plan.rollout.fits, plan.reward.fits if plan.reward else None)
    return 1 if False in fits else 0


def with_reward(
    plan: memory_plan.Plan, spec: GRPOJobSpec, table: instance_types.InstanceTable, args: argparse.Namespace
) -> memory_plan.Plan:
    """The plan with the reward role's row, when the job serves a reward model whose config is here."""
    model = spec.reward.model
    if model is None:
        return plan
    source = args.reward_model_config or memory_plan.find_config(model.path, args.file.parent)
    if source is None:
        print(
            f"note: reward model {model.path} is not a local directory with a config.json: "
            "pass --reward-model-config config.json to plan the reward role",
            file=sys.stderr,
        )
        return plan
    row = memory_plan.plan_reward(
        json.loads(source.read_text()),
        spec,
        gpu_bytes=gpu_bytes(table, model.instance_type),
        prompt_tokens=args.prompt_tokens,
    )
    return dataclasses.replace(plan, reward=row)


def fitting_modes(
    spec: GRPOJobSpec, config: dict[str, Any], table: instance_types.InstanceTable, args: Any
) -> list[str]:
    """The FSDP2 sharding modes under which the trainer would fit."""
    out = []
    for mode in memory_plan.Sharding:
        p = make_plan(spec, config, table, sharding=str(mode), prompt_tokens=args.prompt_tokens)
        if p.trainer.fits:
            out.append(str(mode))
    return out


def show(plan: memory_plan.Plan, source: str, hints: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = plan.model
    console.print(
        f"[bold]{m.model_type}[/] from {source}: {m.total / 1e9:.2f} B parameters "
        f"({m.expert_total / 1e9:.2f} B routed experts, {m.dense_total / 1e9:.2f} B dense)"
    )
    for role in (plan.trainer, plan.rollout, *([plan.reward] if plan.reward else [])):
        console.print(_table(role, Table))
        for note in role.notes:
            console.print(f"  note: {note}")
        colour = {True: "green", False: "red", None: "yellow"}[role.fits]
        console.print(f"[{colour}]{role.verdict()}[/]")
        if role.advice:
            console.print(f"  {role.advice}")
    if hints:
        console.print(f"the trainer would fit with trainer.sharding: {' or '.join(hints)} (FSDP2, issue 10)")


def _table(role: RolePlan, table_cls: Any) -> Any:
    extra = f", sharding {role.extra['sharding']}" if "sharding" in role.extra else ""
    t = table_cls(title=f"{role.role} (per GPU{extra})", title_justify="left")
    t.add_column("part")
    t.add_column("GiB", justify="right")
    t.add_column("formula")
    for name, part in role.parts.items():
        t.add_row(name, f"{part.bytes / GIB:.2f}", part.formula)
    budget = f" of {role.budget / GIB:.1f}" if role.budget is not None else ""
    t.add_row("[bold]total[/]", f"[bold]{role.total / GIB:.2f}[/]", f"per GPU{budget}")
    for name, part in role.host.items():  # optimizerOffload: host RAM per rank, outside the GPU total
        t.add_row(f"host: {name}", f"{part.bytes / GIB:.2f}", part.formula)
    return t
