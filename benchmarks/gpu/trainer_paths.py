"""The trainer's FSDP2 step and its Hugging Face export at world 1, for `run_all.py` (GPU) and its test (CPU).

Loads the tiny Qwen3-MoE through the trainer's own `load_policy` (sharding full: FSDP2 over the
dense part, experts by EP), takes one AdamW step (`GangAdamW`) under bf16 autocast on CUDA, then
writes the model with `checkpoint.export_hf`. On CUDA the process group is NCCL and memory is the
CUDA allocator's; on CPU it is gloo and memory is the process's peak RSS (the law the export's
test holds: it grows by one tensor's room, not the model's).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

TOKENS = 256


@contextlib.contextmanager
def policy(device_type: str) -> Iterator[tuple[torch.nn.Module, Path, torch.device]]:
    """(model, its directory, device) in a world-1 group of the device's backend."""
    from grpo_trainer.config import RankInfo
    from grpo_trainer.parallel import load_policy, make_groups
    from grpo_trainer.tiny_model import TinyConfig, save_untrained

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TinyConfig(experts=4, expert_width=32, head_dim=32, max_positions=512)  # as measured so far
        model_dir = save_untrained(Path(tmp) / "model", cfg)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            info = RankInfo(rank=0, local_rank=0, world_size=1, pod_index=0, ep_size=1)
            model = load_policy(str(model_dir), make_groups(info), backend, device, sharding="full")
            yield model, model_dir, device
        finally:
            dist.destroy_process_group()


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fsdp2_step(device_type: str) -> tuple[float, int | None]:
    """(seconds per step after a warm-up one, peak CUDA bytes during it or None on CPU)."""
    from grpo_trainer.config import RankInfo
    from grpo_trainer.optim import GangAdamW
    from grpo_trainer.parallel import make_groups

    with policy(device_type) as (model, _, device):
        groups = make_groups(RankInfo(rank=0, local_rank=0, world_size=1, pod_index=0, ep_size=1))
        optimizer = GangAdamW(model, groups, lr=1e-5, sharding="full")
        _step(model, optimizer, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        _step(model, optimizer, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return seconds, peak


def _rss(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) << 10


def export_growth(device_type: str) -> tuple[int, int, int]:
    """(bytes the export added to the peak, bytes of the largest tensor in bf16, files written)."""
    from grpo_trainer import checkpoint

    with policy(device_type) as (model, model_dir, device), tempfile.TemporaryDirectory() as out:
        largest = max(p.numel() for p in model.parameters()) * torch.bfloat16.itemsize
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            before = _rss("VmRSS")
        done = checkpoint.export_hf(
            model,
            os.path.join(out, "export"),
            dtype=torch.bfloat16,
            tokenizer_from=str(model_dir),
            device=device,
        )
        after = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss("VmHWM")
    return after - before, largest, done.files
