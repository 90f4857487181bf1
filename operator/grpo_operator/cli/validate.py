"""`grpo-operator validate FILE... [--old OLDFILE]`: check GRPOJob manifests offline.

Gives the API server's verdict without a cluster (see `grpo_operator.validation`): one
line `FILE:LINE: field.path: message` per problem, `FILE: valid` otherwise, and a
non-zero exit status when any file is invalid. Documents of other kinds are skipped. A valid job
that asks for more than GRPOJob `create` grants (privilege, host access, Secrets...) gets one
`FILE:LINE: warning: field.path: message` each: the chart's admission policy refuses it unless
the requester holds the `escalate` verb (docs/security.md). A valid job is held to the memory plan
(docs/memory-plan.md) when the model's config.json is given (`--model-config`) or is a local file: a
trainer that cannot fit in its GPUs' memory makes the file invalid (`spec.trainer: ...`, the message
the trainer's start-up check would stop the job with), a rollout that cannot fit is a warning, and
a model whose config.json is not reachable from here gets a warning that the plan was not checked.
With `--check-paths` every path and reward import path of a valid job is checked from here
(`grpo_operator.validation.paths`: relative to the manifest's folder, pvc:// through `--pvc CLAIM=DIR`
as `grpo-operator run` reads them, s3:// with this environment's AWS credentials): one that does not
resolve is an error naming the field and why, as the trainer would fail the job at its start; and
the prompts are rendered as the model receives them (`grpo-operator preview`, where the `trainer`
extra is installed): a row that cannot be rendered is an error, prompts longer than the rollout
servers take (`spec.rollout.vllm.maxModelLen` minus `maxNewTokens`) a warning.
"""

import argparse
import sys
from pathlib import Path

from grpo_operator import validation
from grpo_operator.cli.run import add_pvc_argument, claims
from grpo_operator.local.plan import PlanError
from grpo_operator.validation import paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML manifests; '-' reads standard input")
    parser.add_argument(
        "--old",
        metavar="OLDFILE",
        help="the jobs as they are now: check FILEs as updates of them, so changes to immutable fields fail",
    )
    parser.add_argument(
        "--model-config",
        type=Path,
        help="the model's config.json, for jobs whose spec.model.path is not a local directory (s3://, pvc://)",
    )
    parser.add_argument(
        "--check-paths",
        action="store_true",
        help="also check that every path (model, dataset, checkpoint, resumeFrom) and reward import path "
        "resolves from here: relative to the file's folder, pvc:// through --pvc, s3:// with this "
        "environment's AWS credentials",
    )
    add_pvc_argument(parser, when="with --check-paths: ")


def run(args: argparse.Namespace) -> int:
    try:
        checks = paths.Options(pvc=claims(args.pvc)) if args.check_paths else None
    except PlanError as e:
        print(f"grpo-operator validate: {e}", file=sys.stderr)
        return 2
    if args.pvc and checks is None:
        print(
            "grpo-operator validate: --pvc is read by --check-paths only; add --check-paths", file=sys.stderr
        )
        return 2
    invalid = 0
    for name in args.files:
        warnings: list[validation.Problem] = []
        try:
            problems = validation.validate_file(
                name, old=args.old, warnings=warnings, model_config=args.model_config, paths=checks
            )
        except OSError as err:
            print(f"{name}: cannot read: {err.strerror or err}", file=sys.stderr)
            invalid += 1
            continue
        if not problems and checks is not None and name != "-":
            problems += _prompt_problems(Path(name), args.pvc, warnings)
        for problem in problems:
            print(problem, file=sys.stderr)
        for w in warnings:
            print(f"{w.file}:{w.line}: warning: {w.path}: {w.message}", file=sys.stderr)
        if problems:
            invalid += 1
        else:
            print(f"{name}: valid")
    return 1 if invalid else 0


def _prompt_problems(
    path: Path, pvc: list[str], warnings: list[validation.Problem]
) -> list[validation.Problem]:
    """Render the job's prompts (`grpo_operator.cli.preview`): an error line for a row that fails,
    warnings for prompts too long; nothing where the trainer extra is missing (said once)."""
    import importlib.util

    from grpo_operator.cli import preview

    if importlib.util.find_spec(preview.WORKER.split(".")[0]) is None:
        print(f"{path}: prompts not rendered: the trainer extra is not installed here", file=sys.stderr)
        return []
    try:
        report = preview.report(path, pvc)
    except PlanError as e:
        return [validation.Problem(str(path), 1, "spec.dataset", str(e))]
    except preview.NotRendered as e:
        warnings.append(validation.Problem(str(path), 1, "spec.dataset", f"prompts not rendered: {e}"))
        return []
    for w in report["warnings"]:
        field, _, message = w.partition(": ")
        warnings.append(validation.Problem(str(path), 1, field, message))
    return []
