"""`grpo-operator crd`: print the GRPOJob CustomResourceDefinition as YAML.

The output is what `crds/grpojobs.grpo.dev.yaml` holds; pipe it to
`kubectl apply --server-side -f -` to install or upgrade the CRD.
"""

import argparse
import sys

from grpo_operator import crd


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write to FILE instead of standard output (e.g. crds/grpojobs.grpo.dev.yaml)",
    )


def run(args: argparse.Namespace) -> int:
    text = crd.crd_yaml()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
