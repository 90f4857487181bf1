"""Prepared GPU check of the EP layer (run on a lent H100/H200; bounded to ~7 minutes).

Run from the repository root: `python benchmarks/gpu/ep_layer_gpu.py --json $OUT/ep_gpu.json`.
1. bf16 matmul peak of the device (torch.mm, CUDA events).
2. Expert throughput: `grouped_swiglu` forward+backward at Qwen3-MoE-like fine-grained shapes,
   `torch._grouped_mm` path versus the per-segment mm path, as a fraction of the peak.
3. The whole layer on CUDA with the `nccl` backend (all-to-all) (world = all visible GPUs,
   1 is fine): tokens/s forward+backward, and its output against the `local` reference.
4. The `deepep` backend when `deep_ep` imports and two or more GPUs are visible: tokens/s and
   agreement with `nccl` on the same batch.
Each part records an error string instead of aborting the rest. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainers"))

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 2048, 768, 128, 8, 8192  # Qwen3-30B-A3B-like layer


def cuda_time(step, iters: int = 10) -> float:
    """Seconds per call of `step` (CUDA events, after two warm-ups)."""
    for _ in range(2):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def matmul_peak() -> dict:
    n = 8192
    a, b = (
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
    )
    seconds = cuda_time(lambda: torch.mm(a, b), iters=20)
    return {"part": "matmul_peak", "tflops": 2 * n**3 / seconds / 1e12}


def expert_throughput(peak_tflops: float) -> list[dict]:
    from grpo_trainer.moe.experts import _SegmentSwiGLU, grouped_swiglu

    rows = []
    n = TOKENS * TOP_K
    counts = torch.distributions.Multinomial(n, torch.ones(EXPERTS)).sample().long().tolist()
    x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate_up = (
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    ).requires_grad_()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    flops = 18 * n * HIDDEN * INTER
    paths = {
        "grouped_mm": lambda: grouped_swiglu(x, w, gate_up, down, counts).sum().backward(),
        "segment_mm": lambda: _SegmentSwiGLU.apply(x, w, gate_up, down, counts).sum().backward(),
    }
    for name, step in paths.items():
        try:
            seconds = cuda_time(step, iters=5)
            tflops = flops / seconds / 1e12
            rows.append({"part": "experts", "path": name, "tflops": tflops, "of_peak": tflops / peak_tflops})
        except Exception as exc:  # record and go on: the other parts still run
            rows.append({"part": "experts", "path": name, "error": repr(exc)})
    return rows


def layer_worker(rank: int, world: int, store: str, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    from grpo_trainer import moe

    rows = []
    torch.manual_seed(0)
    local = EXPERTS // world
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    router = torch.randn(EXPERTS, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=None)
    x = x + rank  # each rank its own batch

    def build(backend: str, group) -> moe.MoELayer:
        lo = rank * local if group is not None else 0
        n = local if group is not None else EXPERTS
        return moe.MoELayer(
            moe.Router(moe.RouterConfig(EXPERTS, TOP_K), HIDDEN, torch.nn.Parameter(router.clone())),
            moe.GroupedExperts(gate_up[lo : lo + n].clone(), down[lo : lo + n].clone(), EXPERTS, lo, group),
            moe.make_dispatcher(backend, group, EXPERTS),
        )

    reference = build("local", None)(x) if world == 1 else None
    from grpo_trainer.moe.backends import deepep_v1

    backends = ["nccl"] + (["deepep"] if world >= 2 and deepep_v1.AVAILABLE else [])  # one node: v1
    outputs = {}
    for backend in backends:
        try:
            layer = build(backend, dist.group.WORLD)
            xs = x.clone().requires_grad_(True)
            seconds = cuda_time(
                lambda layer=layer, xs=xs: layer(xs).float().pow(2).mean().backward(), iters=5
            )
            t = torch.tensor([seconds], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            with torch.no_grad():
                outputs[backend] = layer(x).float()
            row = {"part": "layer", "backend": backend, "world": world, "tokens_per_rank": TOKENS,
                   "tokens_per_s_per_rank": TOKENS / float(t)}  # fmt: skip
            if reference is not None:
                row["max_abs_diff_vs_local"] = float((outputs[backend] - reference.float()).abs().max())
            if backend == "deepep" and "nccl" in outputs:
                row["max_abs_diff_vs_nccl"] = float((outputs[backend] - outputs["nccl"]).abs().max())
            rows.append(row)
        except Exception:
            rows.append(
                {"part": "layer", "backend": backend, "world": world, "error": traceback.format_exc()[-800:]}
            )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "ep_gpu.json")
    parser.add_argument("--budget-s", type=int, default=420, help="hard wall-clock bound")
    args = parser.parse_args()
    signal.alarm(args.budget_s)  # bounded: a hung collective must not eat the device time
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    rows: list[dict] = [
        {"part": "device", "name": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count()}
    ]
    try:
        rows.append(matmul_peak())
        rows += expert_throughput(rows[-1]["tflops"])
    except Exception:
        rows.append({"part": "experts", "error": traceback.format_exc()[-800:]})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows}, indent=2))  # partial results survive a later hang
    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "layer.json")
        try:
            mp.spawn(layer_worker, args=(world, os.path.join(tmp, "store"), out), nprocs=world, join=True)
            rows += json.loads(Path(out).read_text())
        except Exception:
            rows.append({"part": "layer", "error": traceback.format_exc()[-800:]})
    for row in rows:
        print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    args.json.write_text(
        json.dumps({"rows": rows, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
