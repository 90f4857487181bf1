"""Benchmark: the trainer's peak memory per rank against `grpo-operator plan`, world 1, 2 and 4.

Run: `python benchmarks/trainer_memory.py --json mem.json` (a few minutes on 2 cores), or
`--quick` (a small model, for the CI smoke test). What it does:
1. builds a mid-size MoE from a shrunk Qwen3-MoE config whose weights dominate memory (about
   600 MB fp32 at full size, 97 % of it routed experts) and saves it as safetensors;
2. for each row (world, ep, sharding) spawns `world` gloo ranks, one torch thread each; every
   rank runs the trainer's own code: `parallel.load_policy` (sharded loading: meta skeleton, EP,
   FSDP2 under `full`, only local tensors read), `optim.GangAdamW`, then two `step.Learner.train_step`s
   on a `Rollouts` batch built here (no rollout server: rollout batch -> loss -> backward ->
   gradient sync -> clip -> AdamW step; the second step peaks with AdamW state allocated);
3. measures each rank's peak RSS (VmHWM of /proc/self/status), and the RSS
   just before the model is built (interpreter, torch, transformers, gloo);
4. plans the same configuration with `grpo_operator.memory_plan` (the trainer's module, host
   mode: compute dtype fp32, `runtime_bytes` = the RSS measured in 3, no weight-sync buckets
   since no weights are pushed) and prints both.
Rows: {world, ep, sharding, peak_rss_mib_per_rank, planned_mib_per_rank, model_mib, ...}.
The "must be true" of issue 10: world 4 with full sharding peaks at most at half the world-1
peak, and every measured peak is within 30 % of its plan; `--check` exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
for sub in ("trainers", "operator", "rollout", "wire"):
    sys.path.insert(0, str(ROOT / sub))

FULL = dict(hidden=256, layers=6, experts=32, moe_inter=1024, vocab=4096)
QUICK = dict(hidden=64, layers=2, experts=8, moe_inter=128, vocab=512)
# world 4 / EP 2 full: experts split by EP 2 and again by FSDP2 over the 2 ranks sharing each EP block
ROWS = [(1, 1, "full"), (2, 2, "full"), (4, 4, "full"), (4, 4, "optimizer"), (4, 2, "full")]
GROUP, PROMPTS, PROMPT_LEN, NEW_TOKENS, MICRO = 4, 4, 48, 16, 2


def model_config(size: dict) -> dict:
    return dict(
        vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=4 * size["hidden"],
        moe_intermediate_size=size["moe_inter"], num_experts=size["experts"], num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip


def build_model(out: Path, size: dict) -> int:
    """Save a random shrunk Qwen3-MoE as safetensors; its size in bytes."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**model_config(size)))
    model.save_pretrained(out)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def contract(model_dir: str, world: int, ep: int, sharding: str):
    from grpo_operator import render
    from grpo_operator.api.job import GRPOJob

    spec = {
        "model": {"path": model_dir, "dtype": "float32"},
        "dataset": {"path": "/unused.jsonl"},
        "reward": {"functions": [{"builtin": "exact_match"}]},
        "algorithm": {"groupSize": GROUP, "promptsPerStep": PROMPTS, "microBatchSize": MICRO,
                      "maxNewTokens": NEW_TOKENS},
        "trainer": {"replicas": 1, "processesPerPod": world, "expertParallelSize": ep, "sharding": sharding},
    }  # fmt: skip
    job = GRPOJob.model_validate(
        {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "m"}, "spec": spec}
    )
    return render.contract(job, name="m", namespace="t", local_ports=render.LocalPorts(1, (2,)))


def rollouts(vocab: int):
    """PROMPTS x GROUP sequences of PROMPT_LEN + NEW_TOKENS tokens, rewards varying in each group."""
    from grpo_trainer.batch import Rollouts

    gen = torch.Generator().manual_seed(0)
    r = Rollouts(GROUP, [], [], [], [], weight_version=0)
    for p in range(PROMPTS):
        prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()
        for g in range(GROUP):
            r.prompt_tokens.append(prompt)
            r.completion_tokens.append(torch.randint(3, vocab, (NEW_TOKENS,), generator=gen).tolist())
            r.rollout_logprobs.append((-torch.rand(NEW_TOKENS, generator=gen) * 4 - 1).tolist())
            r.rewards.append(float((p + g) % 2))
    return r


def status_mib(field: str) -> float:
    """A /proc/self/status memory field in MiB: VmRSS (now) or VmHWM (peak RSS of this process).

    Not `getrusage().ru_maxrss`: Linux carries it over fork and exec, so a spawned rank would
    report its parent's peak (here: the process that built and saved the model)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def worker(rank: int, world: int, ep: int, sharding: str, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    from grpo_trainer import loading
    from grpo_trainer.config import RankInfo
    from grpo_trainer.losses import LossConfig
    from grpo_trainer.optim import GangAdamW
    from grpo_trainer.parallel import load_policy, make_groups
    from grpo_trainer.step import Learner

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    c = contract(model_dir, world, ep, sharding)
    info = RankInfo(rank=rank, local_rank=rank, world_size=world, pod_index=0, ep_size=ep)
    groups = make_groups(info)
    data = rollouts(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    loading.skeleton(model_dir)  # imports the model's code (meta device: no weights)
    dist.barrier()
    base = status_mib("VmRSS")
    cpu, algo = torch.device("cpu"), c.spec.algorithm
    model = load_policy(model_dir, groups, "gloo", cpu, sharding=sharding)
    loaded = status_mib("VmHWM")
    opt = GangAdamW(model, groups, lr=1e-4, sharding=sharding)
    learner = Learner(
        algo=algo, info=info, groups=groups, device=cpu, dtype=str(c.spec.model.dtype), model=model,
        ref=None, optimizer=opt, loss_cfg=LossConfig.from_spec(algo), pad_id=0,
    )  # fmt: skip
    stats = [learner.train_step(data) for _ in range(2)]
    peak = status_mib("VmHWM")
    row = {"rank": rank, "base_mib": base, "after_load_peak_mib": loaded, "peak_mib": peak,
           "loss": stats[-1].get("loss"), "kept": stats[-1].get("kept")}  # fmt: skip
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_mib(model_dir: Path, world: int, ep: int, sharding: str, runtime_mib: float) -> tuple[float, dict]:
    """`grpo-operator plan`'s trainer arithmetic for this configuration on the host (fp32)."""
    from grpo_operator import memory_plan
    from grpo_operator.memory_plan.inputs import TrainerInputs

    shape = memory_plan.from_config(json.loads((model_dir / "config.json").read_text()))
    inputs = TrainerInputs(
        world=world, ep=ep, sharding=memory_plan.Sharding(sharding), micro_batch=MICRO,
        seq_tokens=PROMPT_LEN + NEW_TOKENS, kl=False, compute_bytes=4, rollout_bytes=4,
        activation_checkpointing=sharding == "full", sync_bucket_bytes=0,
        runtime_bytes=int(runtime_mib * 2**20),
    )  # fmt: skip
    plan = memory_plan.plan_trainer(shape, inputs, None)
    parts = {k: round(p.bytes / 2**20, 1) for k, p in plan.parts.items()}
    return sum(p.bytes for p in plan.parts.values()) / 2**20, parts


def measure(model_dir: Path, world: int, ep: int, sharding: str, tmp: Path) -> list[dict]:
    out = tmp / f"w{world}-ep{ep}-{sharding}.json"
    args = (world, ep, sharding, free_port(), str(model_dir), str(out))
    mp.start_processes(worker, args=args, nprocs=world, start_method="spawn")
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="small model, worlds 1 and 2 (CI smoke)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the must-be-true holds")
    parser.add_argument(
        "--only", action="append", metavar="WORLD,EP,SHARDING", help="run only these rows (repeatable)"
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    size = QUICK if args.quick else FULL
    rows_cfg = ROWS[:2] if args.quick else ROWS
    if args.only:
        rows_cfg = [(int(w), int(e), m) for w, e, m in (o.split(",") for o in args.only)]
    results = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        model_dir = tmp / "model"
        model_mib = build_model(model_dir, size) / 2**20
        for world, ep, sharding in rows_cfg:
            ranks = measure(model_dir, world, ep, sharding, tmp)
            peak = max(r["peak_mib"] for r in ranks)
            base = max(r["base_mib"] for r in ranks)
            planned, parts = plan_mib(model_dir, world, ep, sharding, base)
            row = {
                "world": world, "ep": ep, "sharding": sharding,
                "peak_rss_mib_per_rank": round(peak, 1), "planned_mib_per_rank": round(planned, 1),
                "model_mib": round(model_mib, 1), "plan_error": round(peak / planned - 1, 3),
                "base_rss_mib": round(base, 1),
                "after_load_peak_mib": round(max(r["after_load_peak_mib"] for r in ranks), 1),
                "peaks_mib": [round(r["peak_mib"], 1) for r in ranks], "plan_parts_mib": parts,
            }  # fmt: skip
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "plan_parts_mib"}), flush=True)
    one = next((r for r in results if r["world"] == 1), None)
    w4 = [r for r in results if r["world"] == 4 and r["sharding"] == "full"]
    checks = {
        "world4_full_at_most_half_of_world1": bool(w4 and one)  # the first such row: EP 4
        and w4[0]["peak_rss_mib_per_rank"] <= 0.5 * one["peak_rss_mib_per_rank"],
        "within_30pct_of_plan": all(abs(r["plan_error"]) <= 0.30 for r in results),
    }
    print("| world | EP | sharding | peak RSS MiB/rank | planned MiB/rank | model MiB | peak/plan - 1 |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['world']} | {r['ep']} | {r['sharding']} | {r['peak_rss_mib_per_rank']} | "
              f"{r['planned_mib_per_rank']} | {r['model_mib']} | {r['plan_error']:+.0%} |")  # fmt: skip
    print(json.dumps(checks))
    if args.json:
        report = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__, "rows": results, "checks": checks,
        }  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if (not args.check or all(checks.values())) else 1


if __name__ == "__main__":
    sys.exit(main())
