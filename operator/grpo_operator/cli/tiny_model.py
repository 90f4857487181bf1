"""`grpo-operator tiny-model DIR`: build the demo's tiny MoE model, tokenizer and dataset.

A thin shell: it runs `python -m grpo_trainer.tiny_model DIR` in a subprocess, because the
operator package must not import torch (the operator image carries none). Needs the
`trainer` extra installed in the same interpreter.
"""

import argparse
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory: a Hugging Face model dir plus addition.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seeds init and warm-up (default 0)")
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=0.3,
        help="stop the supervised warm-up at this sampled accuracy (default 0.3)",
    )


def run(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "grpo_trainer.tiny_model", args.dir, "--seed", str(args.seed)]
    cmd += ["--target-accuracy", str(args.target_accuracy)]
    return subprocess.call(cmd)
