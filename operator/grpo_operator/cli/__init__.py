"""The `grpo-operator` command line: one thin dispatcher over small command modules.

Each subcommand lives in its own module under `grpo_operator.cli` exposing
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their
command runs, so `grpo-operator crd` never pays for kopf or the local runtime.
"""

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "crd": ("grpo_operator.cli.crd", "print the GRPOJob CustomResourceDefinition (YAML)"),
    "validate": ("grpo_operator.cli.validate", "validate GRPOJob manifests offline, as the API server would"),
    "render": ("grpo_operator.cli.render", "print the child manifests the operator would create"),
    "plan": ("grpo_operator.cli.plan", "predict per-GPU memory of a GRPOJob's trainer and rollout"),
    "operator": ("grpo_operator.cli.operator", "run the operator against the current kubeconfig"),
    "run": ("grpo_operator.cli.run", "run a GRPOJob on this machine as local processes"),
    "preview": ("grpo_operator.cli.preview", "show a GRPOJob's first prompts as the model receives them"),
    "tiny-model": ("grpo_operator.cli.tiny_model", "build the tiny MoE model and tokenizer used by the demo"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-operator", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
