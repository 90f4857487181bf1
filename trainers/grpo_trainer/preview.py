"""`grpo-operator preview`'s worker: the job's first prompts exactly as the model receives them.

Run as `python -m grpo_trainer.preview SPEC.json [-n N] [--json]` by `grpo_operator.cli.preview`,
which validates the manifest and resolves its paths (relative, `pvc://` through `--pvc`) the way
`grpo-operator run` does, so the operator package never imports transformers. Offline: the rows come
from the job's own dataset (local or `s3://`, streamed as the trainer reads it) and the template from
the job's own model (for `s3://` only its small tokenizer files are fetched, never the weights). The
rendering is the rollout servers' (`grpo_wire.chat`), the rows the trainer's (`grpo_trainer.data`):
what the table shows is what training sends.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from grpo_operator import storage
from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import Reason
from grpo_wire.chat import ChatError, PromptRenderer

from grpo_trainer.config import ConfigError
from grpo_trainer.data import DATASET_FIELD, RowShape, load_rows
from grpo_trainer.prompts import Lengths, prompt_limit, render, renderer_for

EXIT_NO_TOKENIZER = 3  # the model's tokenizer cannot be loaded: nothing was rendered
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
# A multi-turn episode's budget (spec.algorithm.maxNewTokens, shared by every turn and every reply)
# must hold two one-token model turns and a reply of at least this many tokens between them: a short
# sentence. Replies are the environment's or the tools' own, unknown offline; past them the episode
# ends after its first turn (grpo_rollout.episodes: a reply that does not fit is dropped).
MIN_REPLY_TOKENS = 16
# The columns each built-in reward reads (grpo_rollout.rewards: require_column).
BUILTIN_COLUMNS = {
    "exact_match": ("answer",),
    "math": ("answer",),
    "countdown": ("numbers", "target"),
    "format": (),
}


def tokenizer_dir(model: str, into: Path) -> str:
    """A local folder with the model's tokenizer and template: the model's own folder when local;
    for `s3://`, its files but the weights, fetched into `into`."""
    if not storage.is_remote(model):
        return storage.model_dir(model)
    fs, root = storage.filesystem(model)
    for path in fs.find(root):
        rel = path[len(root) :].lstrip("/")
        if rel and not rel.endswith(WEIGHT_SUFFIXES) and "/" not in rel:
            fs.get(path, str(into / rel))
    return str(into)


def reward_columns(spec: GRPOJobSpec) -> dict[str, tuple[str, ...] | None]:
    """Each reward function with the columns it reads (None: a plugin, which may read any)."""
    out: dict[str, tuple[str, ...] | None] = {}
    for fn in spec.reward.functions:
        name = str(fn.builtin) if fn.builtin is not None else str(fn.function)
        out[name] = BUILTIN_COLUMNS.get(name) if fn.builtin is not None else None
    return out


def budget_warning(spec: GRPOJobSpec, renderer: PromptRenderer) -> str | None:
    """A warning when spec.algorithm.maxNewTokens leaves a multi-turn episode no room for a reply of
    MIN_REPLY_TOKENS after the chat template's own tokens (which end a turn and open the next) and
    two one-token model turns; None for single-turn jobs or when there is room."""
    if (not spec.tools and spec.environment is None) or not renderer.uses_template:
        return None
    who = "a tool's" if spec.tools else "the environment's"
    try:  # the template's tokens around an empty reply: closing the turn, the message, the next opening
        overhead = len(renderer.continuation([{"role": "tool" if spec.tools else "user", "content": ""}], ""))
    except (ChatError, ValueError):
        return None  # the trainer's start-up check names what is wrong with the template
    budget = spec.algorithm.max_new_tokens
    room = budget - overhead - 2
    if room >= MIN_REPLY_TOKENS:
        return None
    return (
        f"spec.algorithm.maxNewTokens: {budget} tokens hold every turn of an episode and every reply in it; "
        f"after two one-token model turns and the chat template's {overhead} tokens around a reply, "
        f"{max(room, 0)} are left for {who} reply (fewer than {MIN_REPLY_TOKENS}): most episodes would "
        "end after their first turn (finish_reason length). Raise spec.algorithm.maxNewTokens"
    )


def preview(spec: GRPOJobSpec, n: int) -> dict[str, Any]:
    """The first `n` prompts rendered, the columns of each, every reward's columns and what it
    misses, and the prompt lengths over the whole dataset."""
    rows = load_rows(spec.dataset.path, RowShape.of(spec.dataset))
    with tempfile.TemporaryDirectory(prefix="grpo-preview-") as tmp:
        renderer = renderer_for(spec, tokenizer_dir(spec.model.path, Path(tmp)))
        rendered = render(rows, renderer)
        budget = budget_warning(spec, renderer)
    limit = prompt_limit(spec)
    lengths = Lengths.of(rendered, limit)
    needs = reward_columns(spec)
    prompts = []
    for row, r in list(zip(rows, rendered, strict=True))[:n]:
        missing = {
            name: [c for c in cols if c not in row.columns]
            for name, cols in needs.items()
            if cols is not None
        }
        prompts.append(
            {
                "row": row.where,
                "text": r.text,
                "tokens": len(r.token_ids),
                "columns": row.columns,
                "missing": {k: v for k, v in missing.items() if v},
            }
        )
    return {
        "dataset": spec.dataset.path,
        "model": spec.model.path,
        "chat_template": "the model's own" if renderer.uses_template else "none (raw text)",
        "rewards": {k: list(v) if v is not None else "any (a plugin)" for k, v in needs.items()},
        "prompts": prompts,
        "lengths": {
            "prompts": lengths.count,
            "shortest": lengths.shortest,
            "longest": lengths.longest,
            "mean": round(lengths.mean, 1),
            "limit": lengths.limit,
            "over_limit": lengths.over,
        },
        "warnings": [w for w in [lengths.warning(DATASET_FIELD), budget] if w],
    }


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    console.print(
        f"[bold]{escape(report['dataset'])}[/] through {escape(report['chat_template'])} chat template of "
        f"{escape(report['model'])}"
    )
    rewards = ", ".join(
        f"{k} reads {v if isinstance(v, str) else ', '.join(v) or 'no column'}"
        for k, v in report["rewards"].items()
    )
    console.print(f"rewards: {escape(rewards)}")
    for p in report["prompts"]:
        console.rule(f"{escape(p['row'])}  ({p['tokens']} tokens)")
        console.print(escape(p["text"]), markup=True)
        console.print(f"[dim]columns:[/] {escape(json.dumps(p['columns'], ensure_ascii=False))}")
        for reward, cols in p["missing"].items():
            console.print(
                f"[bold red]{escape(reward)} needs column(s) {escape(', '.join(cols))}: not in this row[/]"
            )
    s = report["lengths"]
    console.rule()
    limit = f", limit {s['limit']}" if s["limit"] is not None else ""
    console.print(f"{s['prompts']} prompts, {s['shortest']}-{s['longest']} tokens (mean {s['mean']}){limit}")
    for w in report["warnings"]:
        console.print(f"[bold yellow]warning:[/] {escape(w)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_trainer.preview", description=__doc__.splitlines()[0]
    )
    parser.add_argument("spec", type=Path, help="the GRPOJob's spec as JSON, paths resolved")
    parser.add_argument("-n", type=int, default=3, help="prompts to show (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    spec = GRPOJobSpec.model_validate_json(args.spec.read_text())
    try:
        report = preview(spec, max(0, args.n))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_TOKENIZER if e.reason == Reason.MODEL_INVALID else 2
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
