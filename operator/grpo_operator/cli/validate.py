"""`grpo-operator validate FILE... [--old OLDFILE]`: check GRPOJob manifests offline.

Gives the API server's verdict without a cluster (see `grpo_operator.validation`): one
line `FILE:LINE: field.path: message` per problem, `FILE: valid` otherwise, and a
non-zero exit status when any file is invalid. Documents of other kinds are skipped. A valid job
that asks for more than GRPOJob `create` grants (privilege, host access, Secrets...) gets one
`FILE:LINE: warning: field.path: message` each: the chart's admission policy refuses it unless
the requester holds the `escalate` verb (docs/security.md). A valid job whose model config.json is a
local file also gets a `warning: spec.trainer: ...` (or `spec.rollout`) when `grpo-operator plan`
says that role cannot fit in its GPUs' memory (docs/memory-plan.md).
"""

import argparse
import sys

from grpo_operator import validation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML manifests; '-' reads standard input")
    parser.add_argument(
        "--old",
        metavar="OLDFILE",
        help="the jobs as they are now: check FILEs as updates of them, so changes to immutable fields fail",
    )


def run(args: argparse.Namespace) -> int:
    invalid = 0
    for name in args.files:
        warnings: list[validation.Problem] = []
        try:
            problems = validation.validate_file(name, old=args.old, warnings=warnings)
        except OSError as err:
            print(f"{name}: cannot read: {err.strerror or err}", file=sys.stderr)
            invalid += 1
            continue
        for problem in problems:
            print(problem, file=sys.stderr)
        for w in warnings:
            print(f"{w.file}:{w.line}: warning: {w.path}: {w.message}", file=sys.stderr)
        if problems:
            invalid += 1
        else:
            print(f"{name}: valid")
    return 1 if invalid else 0
