"""Benchmark: our expert-parallel MoE layer against DeepSpeed MoE (dropless), EP = 1, 2, 4 on gloo.

Run: `python benchmarks/ep_layer.py --json ep.json` (full, a few minutes on 2 cores) or
`--quick` (smoke run used by tests/integration/test_moe_benchmark.py). For each EP size one
group of real processes (1 thread each) times forward+backward of both layers at the same
shapes and the same routing in three regimes:
- coarse: 8 experts, top-2, wide experts (width 512), balanced routing;
- fine: 64 experts, top-8, narrow experts (width 64), balanced routing (Qwen3-MoE/DeepSeek-V3-like);
- skewed: 32 experts, top-4, width 128, Zipf-like expert popularity (RL without a balancing loss).
The roofline is the expert FLOPs (forward+backward SwiGLU GEMMs) over the fp32 matmul rate
measured here at the same thread count: each rank runs its own experts' GEMMs as single large
matmuls, timed (slowest rank) interleaved with both layers, so that load from other processes
affects all three alike. Every step starts from fresh gradients (as after
`zero_grad(set_to_none=True)`), for both layers. A fourth timed step runs our layer's local
experts alone on the rows of one dispatch: `experts/roof` shows how much of the roofline the
grouped GEMMs and SwiGLU reach before routing and the exchange are added.
Prints a table; writes JSON rows
{regime, ep, tokens, ours_tokens_per_s, deepspeed_tokens_per_s, ratio, roofline_tokens_per_s,
ours_experts_only_tokens_per_s, ours_bytes_sent_per_rank_per_s, ...}.
Tokens/s are per rank (the slowest rank's time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


@dataclass(frozen=True)
class Regime:
    name: str
    experts: int
    top_k: int
    width: int
    zipf: float  # 0: balanced; s > 0: expert e is chosen with weight (e + 1) ** -s


# glibc serves blocks above a dynamic threshold with fresh mmap()s and gives freed heap back
# early, so every step page-faults its multi-MB activations in again (kernel time, worse under
# load). PyTorch's CPU tuning guides use jemalloc/tcmalloc for this; these two settings do the
# same for glibc. Applied to the whole process, i.e. to DeepSpeed and to our layer alike.
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}

REGIMES = (
    Regime("coarse", experts=8, top_k=2, width=512, zipf=0.0),
    Regime("fine", experts=64, top_k=8, width=64, zipf=0.0),
    Regime("skewed", experts=32, top_k=4, width=128, zipf=1.2),
)


class SwiGLU(nn.Module):
    """DeepSpeed's expert: the same SwiGLU MLP as one of ours."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def expert_gemms(rows: int, hidden: int, width: int):
    """The roofline workload: the six GEMMs of a SwiGLU expert's forward+backward over `rows` rows,
    as single large matmuls (18 * rows * hidden * width FLOPs, no routing, no elementwise work)."""
    x, dy = torch.randn(rows, hidden), torch.randn(rows, hidden)
    h, a = torch.randn(rows, 2 * width), torch.randn(rows, width)
    gate_up, down = torch.randn(2 * width, hidden), torch.randn(hidden, width)
    y, da, dx = torch.empty(rows, hidden), torch.empty(rows, width), torch.empty(rows, hidden)
    d_gate_up, d_down = torch.empty(2 * width, hidden), torch.empty(hidden, width)

    def step() -> None:
        torch.mm(x, gate_up.t(), out=h)  # forward
        torch.mm(a, down.t(), out=y)
        torch.mm(dy, down, out=da)  # backward: activations and weights
        torch.mm(dy.t(), a, out=d_down)
        torch.mm(h.t(), x, out=d_gate_up)
        torch.mm(h, gate_up, out=dx)

    return step


def make_inputs(regime: Regime, tokens: int, hidden: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and a router weight whose softmax top-k follows the regime's expert popularity.

    Column 0 of the input is a constant 1 and column 0 of the router weight holds the log
    popularity, so logits = log p_e + per-token noise (the other columns, identical weights on
    every rank). With skew the noise has the spread of a Gumbel variable (std pi/sqrt(6)), so
    top-k picks experts roughly in proportion to p_e (the Gumbel top-k trick).
    """
    gen = torch.Generator().manual_seed(1234)
    noise_std = 1.28 if regime.zipf else 0.5
    weight = torch.randn(regime.experts, hidden, generator=gen) * noise_std / (hidden - 1) ** 0.5
    weight[:, 0] = 0.0
    if regime.zipf:
        popularity = torch.arange(1, regime.experts + 1, dtype=torch.float32) ** -regime.zipf
        weight[:, 0] = popularity.log()
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))
    x[:, 0] = 1.0
    return x, weight


def time_steps(steps: list, iters: int) -> list[float]:
    """Median seconds per call of each step, the slowest rank's time in each round.

    Steps run interleaved, round after round, so that load from other processes on the machine
    hits all of them alike; the median discards rounds hit by a burst. Two warm-up rounds.
    """
    for _ in range(2):
        for step in steps:
            step()
    times = torch.zeros(iters, len(steps), dtype=torch.float64)
    for i in range(iters):
        for j, step in enumerate(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            times[i, j] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.median(dim=0).values.tolist()


def ours(regime: Regime, x: torch.Tensor, weight: torch.Tensor, ep: int, rank: int):
    from grpo_trainer import moe

    group = dist.group.WORLD if ep > 1 else None
    local = regime.experts // ep
    torch.manual_seed(7)
    gate_up = torch.randn(local, 2 * regime.width, x.shape[1]) * x.shape[1] ** -0.5
    down = torch.randn(local, x.shape[1], regime.width) * regime.width**-0.5
    config = moe.RouterConfig(num_experts=regime.experts, top_k=regime.top_k, norm_topk_prob=True)
    return moe.MoELayer(
        moe.Router(config, x.shape[1], nn.Parameter(weight.clone())),
        moe.GroupedExperts(gate_up, down, regime.experts, first_expert=rank * local, group=group),
        moe.make_dispatcher("gloo" if ep > 1 else "local", group, regime.experts),
    )


def deepspeed_layer(regime: Regime, x: torch.Tensor, weight: torch.Tensor, ep: int):
    from deepspeed.moe.layer import MoE

    layer = MoE(
        hidden_size=x.shape[1],
        expert=SwiGLU(x.shape[1], regime.width),
        num_experts=regime.experts,
        ep_size=ep,
        k=regime.top_k,
        drop_tokens=False,
        use_rts=False,
    )
    layer.set_deepspeed_parallelism()
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(weight)
    return layer


def rows_per_rank(layer, x: torch.Tensor, regime: Regime, ep: int) -> list[int]:
    """(token, expert) rows each rank's experts process in one step, all ranks' batches together."""
    with torch.no_grad():
        idx = layer.gate(x)[2]
    per_expert = torch.bincount(idx.reshape(-1), minlength=regime.experts)
    if ep > 1:
        dist.all_reduce(per_expert)
    return per_expert.view(ep, -1).sum(1).tolist()


def training_step(module: nn.Module, x: torch.Tensor, output) -> Callable[[], None]:
    """Forward+backward from fresh gradients, as after `zero_grad(set_to_none=True)` in training:
    without it every step would also add each gradient into the last one."""

    def step() -> None:
        for p in (*module.parameters(), x):
            p.grad = None
        output(module, x).pow(2).mean().backward()

    return step


def experts_only(layer, x: torch.Tensor) -> Callable[[], None]:
    """Our layer's local experts alone (grouped GEMMs + SwiGLU), forward+backward, on the rows one
    dispatch delivers: what is left between this and the whole layer is routing and exchange."""
    with torch.no_grad():
        _, weights, idx = layer.gate(x)
        sent = layer.dispatcher.dispatch(x, idx, weights)
    rows, w = sent.rows.clone().requires_grad_(True), sent.weights.clone().requires_grad_(True)

    def step() -> None:
        for p in (*layer.experts.parameters(), rows, w):
            p.grad = None
        layer.experts(rows, sent.counts, w).pow(2).mean().backward()

    return step


def measure_regime(regime: Regime, args: argparse.Namespace, ep: int, rank: int) -> dict:
    x, weight = make_inputs(regime, args.tokens, args.hidden, rank)
    layer = ours(regime, x, weight, ep, rank)
    ds = deepspeed_layer(regime, x, weight, ep)
    rows = rows_per_rank(layer, x, regime, ep)  # the roofline step: each rank its own expert GEMMs
    xs, xd = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    experts_step = experts_only(layer, x)
    bytes_before = layer.dispatcher.bytes_sent
    seconds_ours, seconds_ds, seconds_gemm, seconds_experts = time_steps(
        [
            training_step(layer, xs, lambda m, x: m(x)),
            training_step(ds, xd, lambda m, x: m(x)[0]),
            expert_gemms(rows[rank], args.hidden, regime.width),
            experts_step,
        ],
        args.iters,
    )
    sent_per_step = (layer.dispatcher.bytes_sent - bytes_before) / (args.iters + 2)
    flops = 18 * max(rows) * args.hidden * regime.width
    return {
        "regime": regime.name,
        "ep": ep,
        "tokens": args.tokens,
        "ours_tokens_per_s": args.tokens / seconds_ours,
        "deepspeed_tokens_per_s": args.tokens / seconds_ds,
        "ratio": seconds_ds / seconds_ours,
        "roofline_tokens_per_s": args.tokens / seconds_gemm,
        "ours_experts_only_tokens_per_s": args.tokens / seconds_experts,
        "ours_bytes_sent_per_rank_per_s": sent_per_step / seconds_ours,
        "experts": regime.experts,
        "top_k": regime.top_k,
        "expert_width": regime.width,
        "zipf": regime.zipf,
        "hidden": args.hidden,
        "busiest_rank_rows": max(rows),
        "matmul_gflops": flops / seconds_gemm / 1e9,
    }


def worker(rank: int, ep: int, store: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ep)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    rows = [measure_regime(regime, args, ep, rank) for regime in REGIMES]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'regime':8} {'EP':>3} {'ours tok/s':>11} {'DS tok/s':>10} {'ours/DS':>8} {'roofline':>9} "
        f"{'ours/roof':>9} {'experts/roof':>12} {'MB/s sent':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['regime']:8} {r['ep']:>3} {r['ours_tokens_per_s']:>11.0f} "
            f"{r['deepspeed_tokens_per_s']:>10.0f} "
            f"{r['ratio']:>8.2f} {r['roofline_tokens_per_s']:>9.0f} "
            f"{r['ours_tokens_per_s'] / r['roofline_tokens_per_s']:>9.2f} "
            f"{r['ours_experts_only_tokens_per_s'] / r['roofline_tokens_per_s']:>12.2f} "
            f"{r['ours_bytes_sent_per_rank_per_s'] / 1e6:>10.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny shapes, EP 1 and 2, 1 iteration"
    )
    parser.add_argument("--eps", default="1,2,4", help="EP sizes (comma separated)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--iters", type=int, default=9, help="timed rounds per regime (median taken)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's allocator defaults (see TUNED_MALLOC) for both layers",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.eps, args.tokens, args.hidden, args.iters = "1,2", 128, 64, 1
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/grpo-operator/torch_extensions"))
    os.environ.setdefault("DS_BUILD_OPS", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not args.default_malloc:
        for key, value in TUNED_MALLOC.items():  # inherited by the spawned ranks, both layers alike
            os.environ.setdefault(key, value)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for ep in (int(e) for e in args.eps.split(",")):
            with socket.socket() as s:  # DeepSpeed reads MASTER_PORT even when torch is up
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
            out = os.path.join(tmp, f"ep{ep}.json")
            mp.spawn(worker, args=(ep, os.path.join(tmp, f"store{ep}"), args, out), nprocs=ep, join=True)
            rows += json.loads(Path(out).read_text())
    print_table(rows)
    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            "threads_per_rank": args.threads,
            "quick": args.quick,
            "malloc": {key: os.environ.get(key) for key in TUNED_MALLOC},
        }
        args.json.write_text(json.dumps({"rows": rows, **meta}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
