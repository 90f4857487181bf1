"""`grpo-operator preview JOB.yaml [-n N] [--json] [--pvc CLAIM=DIR]`: the job's first prompts as the
model receives them, offline.

The manifest is validated and its paths resolved as `grpo-operator run` resolves them (relative to
its folder, `pvc://` through `--pvc`, `s3://` kept); then a thin shell: `python -m
grpo_trainer.preview` renders the prompts in a subprocess (the operator package never imports
transformers; it needs the `trainer` extra in the same interpreter). Shows each prompt after the
chat template, its token count, the columns the reward functions get (and any a built-in reward
needs but the row lacks), and the prompt lengths over the whole dataset; `--json` prints the same as
one object. `grpo-operator validate --check-paths` reads its warnings (prompts longer than the
rollout servers take).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from grpo_operator.cli.run import add_pvc_argument, claims
from grpo_operator.local.plan import PlanError, load_job, localize

WORKER = "grpo_trainer.preview"
EXIT_NO_TOKENIZER = 3  # grpo_trainer.preview's: the model's tokenizer cannot be loaded


class NotRendered(Exception):
    """The prompts could not be rendered at all (no tokenizer to load): said, not an error of the file."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="the GRPOJob manifest")
    parser.add_argument("-n", type=int, default=3, help="prompts to show (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    add_pvc_argument(parser)


def worker_command(job_file: Path, pvc: list[str], spec_file: Path, *extra: str) -> list[str]:
    """Resolve the job's paths and write its spec for the worker; the command that runs it."""
    job = load_job(job_file)
    with tempfile.TemporaryDirectory(prefix="grpo-preview-") as workdir:
        spec = localize(job, base=job_file.parent, workdir=Path(workdir), pvc=claims(pvc)).spec
    spec_file.write_text(spec.model_dump_json(by_alias=True, exclude_none=True))
    return [sys.executable, "-m", WORKER, str(spec_file), *extra]


def report(job_file: Path, pvc: list[str]) -> dict[str, Any]:
    """The worker's JSON report with no prompt shown (lengths and warnings); PlanError for a row that
    cannot be rendered, NotRendered when nothing could be (a path or the tokenizer out of reach)."""
    with tempfile.TemporaryDirectory(prefix="grpo-preview-") as tmp:
        try:
            cmd = worker_command(job_file, pvc, Path(tmp) / "spec.json", "-n", "0", "--json")
        except PlanError as e:  # a path not reachable from here: the path check says so
            raise NotRendered(str(e)) from None
        done = subprocess.run(cmd, capture_output=True, text=True)
    why = done.stderr.strip().removeprefix("error: ") or f"{WORKER} exited {done.returncode}"
    if done.returncode == EXIT_NO_TOKENIZER:
        raise NotRendered(why)
    if done.returncode != 0:
        raise PlanError(why)
    return json.loads(done.stdout)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="grpo-preview-") as tmp:
        try:
            cmd = worker_command(args.file, args.pvc, Path(tmp) / "spec.json", "-n", str(args.n))
        except PlanError as e:
            print(f"grpo-operator preview: {e}", file=sys.stderr)
            return 2
        return subprocess.call([*cmd, *(["--json"] if args.json else [])])
