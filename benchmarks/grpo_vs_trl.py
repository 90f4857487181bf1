"""GRPO throughput and final reward: our local runtime against TRL's GRPOTrainer, in one run.

Run: `python benchmarks/grpo_vs_trl.py --json out/grpo_vs_trl.json` (builds the tiny model
unless --model is given). Both sides train the same tiny Qwen3-MoE model on the same
addition task with the same hyperparameters (group size, prompts per step, max new tokens,
learning rate, clip range, steps, temperature, no KL), each in a child process of this one:
ours as `grpo-operator run` (1 rollout server + --trainer-ranks ranks at EP = ranks, 1 thread
each; default 1 rank: on 2 cores one rollout server and one trainer rank is one process per
core, and the EP all-to-all of 2 ranks costs more than it saves on a 229k-parameter model;
--trainer-ranks 2 is the demo's layout),
TRL as `GRPOTrainer` (use_vllm=False, use_cpu=True, bf16=False) with --trl-threads torch threads
(default 1: on this tiny model TRL runs as fast with one thread as with two on an idle 2-core
machine, and several times slower with two on a busy one).

Measured the same way on both sides:
  wall_s         seconds from spawning the child to its exit (imports, model load included)
  samples_per_s  completions of steps 2..N over the time between step 1's and step N's end
  reward_last    mean reward over the last 10% of steps (reward_first: the first 10%)
and `speedup` = ours.samples_per_s / trl.samples_per_s. With --max-tokens-per-micro-batch N a
third side, `ours_packed`, runs ours again with algorithm.maxTokensPerMicroBatch = N (length-sorted
micro-batches of at most N padded tokens instead of one padded micro-batch of the whole step);
`packing_speedup` = ours_packed.samples_per_s / ours.samples_per_s. It matters where completion
lengths are long-tailed: with --max-new-tokens 32 the warmed-up tiny model mostly answers in two
tokens ("7<eos>"), and a few samples ramble to the limit. The sides run --repeats times each,
alternating, and each side's fastest run is reported (best-of-N damps outside load; every
run's samples/s is in the JSON too). Each run records the 1-minute load
average when it started: on a shared machine other work skews the comparison (ours runs three
processes, TRL one, so a busy machine lends ours a larger share). Prints a table; writes JSON.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


def tenth_means(rewards: list[float]) -> tuple[float, float]:
    """Mean reward over the first and the last 10% of steps (at least one step each)."""
    k = max(1, math.ceil(len(rewards) * 0.1))
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def fail(what: str, output: Path) -> None:
    """Stop the benchmark, quoting the failed side's output (its temporary folder goes away)."""
    tail = "\n".join(output.read_text(errors="replace").splitlines()[-40:])
    sys.exit(f"{tail}\n{what}")


def job_manifest(model: Path, args: argparse.Namespace, max_tokens: int | None = None) -> dict[str, Any]:
    """Our GRPOJob for the benchmark; `max_tokens`: micro-batches by token budget (packing row)."""
    budget = {"maxTokensPerMicroBatch": max_tokens} if max_tokens else {}
    return {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPOJob",
        "metadata": {"name": "bench-ours"},
        "spec": {
            "model": {"path": str(model), "dtype": "float32"},
            "dataset": {"path": str(model / "addition.jsonl")},
            "reward": {"functions": [{"builtin": "exact_match"}]},
            "algorithm": {
                "groupSize": args.group_size,
                "promptsPerStep": args.prompts_per_step,
                "microBatchSize": args.prompts_per_step * args.group_size,
                "maxSteps": args.steps,
                "learningRate": args.lr,
                "maxNewTokens": args.max_new_tokens,
                "clipLow": 0.2,
                "clipHigh": 0.28,
                "klCoef": 0.0,
                "temperature": 1.0,
                "maxStaleness": args.max_staleness,
                "seed": 0,
                **budget,
            },
            "trainer": {
                "replicas": 1,
                "processesPerPod": args.trainer_ranks,
                "expertParallelSize": args.trainer_ranks,
                "epBackend": "gloo",
            },
            "rollout": {"replicas": 1, "engine": "torch"},
            "checkpoint": {"everySteps": args.steps},
        },
    }


def run_ours(
    model: Path, args: argparse.Namespace, parent: Path, max_tokens: int | None = None
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ours-", dir=parent))  # fresh: never resume an earlier run
    job = work / "ours.yaml"
    job.write_text(yaml.safe_dump(job_manifest(model, args, max_tokens)))
    summary = work / "ours-summary.json"
    cmd = [sys.executable, "-m", "grpo_operator.cli", "run", str(job), "--summary-json", str(summary)]
    cmd += ["--workdir", str(work / "ours")]
    load, start = os.getloadavg()[0], time.monotonic()
    with open(work / "ours.out", "wb") as out:
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if code != 0:
        fail(f"our run failed (exit {code})", work / "ours.out")
    s = json.loads(summary.read_text())
    return {"wall_s": wall, "samples_per_s": s["samples_per_s"], "reward_first": s["reward_first"],
            "reward_last": s["reward_last"], "steps": s["steps"], "loadavg_1m_at_start": load}  # fmt: skip


def run_trl(model: Path, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--trl-worker", str(model), "--json", str(work / "trl.json")]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in HYPER]
    load, start = os.getloadavg()[0], time.monotonic()
    with open(work / "trl.out", "wb") as out:
        code = subprocess.call(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
    wall = time.monotonic() - start
    if code != 0:
        fail(f"the TRL run failed (exit {code})", work / "trl.out")
    return {"wall_s": wall, **json.loads((work / "trl.json").read_text()), "loadavg_1m_at_start": load}


def trl_worker(model: Path, args: argparse.Namespace) -> None:
    """Child process: TRL GRPOTrainer on the tiny model; writes samples/s and rewards as JSON."""
    import torch
    from datasets import Dataset
    from grpo_rollout.rewards.builtin.exact_match import exact_match
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.trl_threads)
    torch.manual_seed(0)
    rows = [json.loads(line) for line in (model / "addition.jsonl").read_text().splitlines() if line.strip()]
    # conversational rows: TRL puts them through the model's chat template, as our rollout servers do
    rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]

    def exact_match_chat(prompts: list, completions: list, **columns: Any) -> list[float]:
        """exact_match on the assistant turn's text (TRL hands conversational completions as messages)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return exact_match(prompts, texts, **columns)

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ends: list[float] = []
    rewards: list[float] = []

    class Record(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(time.time())

        def on_log(self, *_: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    batch = args.prompts_per_step * args.group_size
    config = GRPOConfig(
        output_dir=str(Path(args.json).parent / "trl-out"),
        num_generations=args.group_size,
        per_device_train_batch_size=batch,  # one optimizer step per generation batch, as ours
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token-level mean over the batch: our token-mean aggregation
        temperature=1.0,
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=exact_match_chat,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    trainer.train()
    first, last = tenth_means(rewards)
    samples_per_s = (len(ends) - 1) * batch / (ends[-1] - ends[0])
    result = {"samples_per_s": samples_per_s, "reward_first": first, "reward_last": last, "steps": len(ends)}
    Path(args.json).write_text(json.dumps(result))


HYPER = ("steps", "prompts_per_step", "group_size", "max_new_tokens", "lr", "max_staleness", "trl_threads")
LAYOUT = ("trainer_ranks", "repeats", "max_tokens_per_micro_batch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the comparison")
    parser.add_argument(
        "--model", type=Path, help="tiny model dir (default: build one with grpo-operator tiny-model)"
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--max-staleness", type=int, default=1, help="ours only: rollout/train overlap")
    parser.add_argument("--trainer-ranks", type=int, default=1, help="ours only: trainer ranks (EP size)")
    parser.add_argument(
        "--trl-threads", type=int, default=1, help="TRL's torch threads (1 is its fastest on this tiny model)"
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per side, alternating; the fastest counts"
    )
    parser.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        help="also run ours with micro-batches of at most this many padded tokens (the packing row)",
    )
    parser.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker, args)
        return
    with tempfile.TemporaryDirectory(prefix="grpo-vs-trl-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            model = work / "tiny"
            subprocess.run([sys.executable, "-m", "grpo_operator.cli", "tiny-model", str(model)], check=True)
        budget = args.max_tokens_per_micro_batch
        runs: dict[str, list[dict[str, Any]]] = {
            "ours": [],
            "trl": [],
            **({"ours_packed": []} if budget else {}),
        }
        for _ in range(args.repeats):  # alternate, so both sides see the same spells of outside load
            runs["ours"].append(run_ours(model.resolve(), args, work))
            runs["trl"].append(run_trl(model.resolve(), args, work))
            if budget:
                runs["ours_packed"].append(run_ours(model.resolve(), args, work, budget))
    best = {side: max(rs, key=lambda r: r["samples_per_s"]) for side, rs in runs.items()}
    ours, trl = best["ours"], best["trl"]
    speedup = ours["samples_per_s"] / trl["samples_per_s"]
    result = {
        **best,
        "speedup": speedup,
        "hyperparameters": {k: getattr(args, k) for k in HYPER + LAYOUT},
        "samples_per_s_of_every_run": {side: [r["samples_per_s"] for r in rs] for side, rs in runs.items()},
    }
    if budget:
        result["packing_speedup"] = best["ours_packed"]["samples_per_s"] / ours["samples_per_s"]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'':12}{'wall_s':>10}{'samples/s':>12}{'reward_first':>14}{'reward_last':>13}")
    for name, r in best.items():
        row = (
            f"{r['wall_s']:10.1f}{r['samples_per_s']:12.1f}{r['reward_first']:14.3f}{r['reward_last']:13.3f}"
        )
        print(f"{name:12}{row}")
    print(f"speedup (samples/s, ours / TRL): {speedup:.2f}x")
    if budget:
        print(f"packing speedup (samples/s, ours_packed / ours): {result['packing_speedup']:.2f}x")


if __name__ == "__main__":
    main()
