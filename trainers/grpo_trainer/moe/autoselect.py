"""The `auto` EP backend: choose a real backend by cluster shape and a start-up measurement.

Registered in `grpo_trainer.moe.dispatch`; `expert_parallel(..., backend="auto")` ends up here
when the EP group has more than one rank. Candidates: `alltoall` always; `deepep` when
`deep_ep` imports, the group is on CUDA and its size is one DeepEP supports. Each candidate
times a few dispatch+combine round trips of a synthetic batch; the slowest rank's time counts
(all-reduce MAX), so every rank picks the same backend. On EFA, NCCL all-to-all often beats
DeepEP at small EP and loses at large EP, which is why this is measured rather than assumed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from grpo_trainer.moe.dispatch import Dispatcher, available_backends, make_dispatcher, register_backend

DEEPEP_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)


def candidates(group: dist.ProcessGroup | None) -> list[str]:
    """Backends worth measuring for this group."""
    names = ["alltoall"]
    on_cuda = dist.get_backend(group) == "nccl" and torch.cuda.is_available()
    if on_cuda and "deepep" in available_backends() and dist.get_world_size(group) in DEEPEP_SIZES:
        names.append("deepep")
    return names


def measure(
    dispatcher: Dispatcher,
    group: dist.ProcessGroup | None,
    num_experts: int,
    tokens: int = 1024,
    hidden: int = 1024,
    top_k: int = 4,
    iters: int = 3,
) -> float:
    """Seconds per dispatch+combine round trip of random routing, slowest rank (identical on all)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    x = torch.randn(tokens, hidden, device=device)
    idx = torch.rand(tokens, num_experts, device=device).topk(min(top_k, num_experts), dim=1)[1]
    weights = torch.full(idx.shape, 1.0 / idx.shape[1], device=device)
    with torch.no_grad():
        sent = dispatcher.dispatch(x, idx, weights)  # warm-up: buffers, connections
        dispatcher.combine(sent.rows, sent.handle)
        if device is not None:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            sent = dispatcher.dispatch(x, idx, weights)
            dispatcher.combine(sent.rows, sent.handle)
        if device is not None:
            torch.cuda.synchronize()
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def choose_backend(group: dist.ProcessGroup | None, num_experts: int) -> tuple[Dispatcher, dict[str, float]]:
    """The fastest candidate's dispatcher and every candidate's measured seconds per round trip."""
    times: dict[str, float] = {}
    built: dict[str, Dispatcher] = {}
    for name in candidates(group):
        built[name] = make_dispatcher(name, group, num_experts)
        times[name] = measure(built[name], group, num_experts)
    best = min(times, key=times.__getitem__)
    built[best].bytes_sent = 0
    built[best].clock.take()  # the measurement is not training time
    return built[best], times


@register_backend("auto")
def auto_dispatcher(group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    """`local` for one rank, otherwise the measured fastest backend (see `choose_backend`)."""
    if group is None or dist.get_world_size(group) == 1:
        return make_dispatcher("local", None, num_experts)
    dispatcher, times = choose_backend(group, num_experts)
    dispatcher.measured = times  # kept for logs and benchmarks
    return dispatcher
