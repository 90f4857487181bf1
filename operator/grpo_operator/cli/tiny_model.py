"""`grpo-operator tiny-model DIR [--task addition|calculator]`: build a tiny MoE model, tokenizer and dataset.

`--reward-classifier` builds a tiny sequence-classification reward model instead (spec.reward.model,
kind classifier); the tiny policy itself serves as a generative judge.

A thin shell: it runs `python -m grpo_trainer.tiny_model DIR` in a subprocess, because the
operator package must not import torch (the operator image carries none). Needs the
`trainer` extra installed in the same interpreter.
"""

import argparse
import subprocess
import sys

TASKS = {"addition": "grpo_trainer.tiny_model", "calculator": "grpo_trainer.tiny_calculator"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory: a Hugging Face model dir plus the task's dataset")
    parser.add_argument(
        "--task",
        choices=sorted(TASKS),
        default="addition",
        help="addition (default): single-digit sums, the demo's; calculator: powers the model answers "
        "by calling the calculator tool (examples/tiny-local-calculator.yaml)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds init and warm-up (default 0)")
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=0.3,
        help="stop the supervised warm-up at this sampled accuracy (default 0.3)",
    )
    parser.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help="attention head width (default 16); vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, ... "
        "(`make demo ENGINE=vllm` builds with 32)",
    )
    parser.add_argument(
        "--reward-classifier",
        action="store_true",
        help="write a tiny sequence-classification reward model (one output, random weights, the same "
        "tokenizer) instead of the policy, for spec.reward.model with kind classifier",
    )


def run(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", TASKS[args.task], args.dir, "--seed", str(args.seed)]
    cmd += ["--target-accuracy", str(args.target_accuracy)]
    if args.head_dim is not None:
        cmd += ["--head-dim", str(args.head_dim)]
    if args.reward_classifier:
        cmd = [sys.executable, "-m", "grpo_trainer.tiny_model", args.dir, "--seed", str(args.seed)]
        cmd += ["--reward-classifier"]
    return subprocess.call(cmd)
