"""Prepared GPU check of `trainer.optimizerOffload: cpu` (one H100/H200; a few minutes with the op build).

Run from the repository root: `python benchmarks/gpu/optimizer_offload_gpu.py --json $OUT/offload.json`;
exit status 0 when every check passes, 1 otherwise. Not run in CI (no GPU there). The first run
JIT-builds DeepSpeed's `cpu_adam` op (ninja and a C++ compiler) into TORCH_EXTENSIONS_DIR.

Parameters on the GPU in fp32 (the trainer's master weights), 268 M of them (1 GiB) in tensors of
a decoder layer's shapes; the same gradients (fixed, so the two runs cannot drift apart through
the model) go to `torch.optim.AdamW` on the GPU and to `grpo_trainer.offload.CPUOffloadAdamW`:
1. after `STEPS` steps the parameters agree within `TOLERANCE` (absolute; lr 1e-3);
2. the offloaded state (`exp_avg`, `exp_avg_sq`) and the fp32 copies it updates are host tensors,
   pinned; its `step` is torch AdamW's float tensor;
3. GPU memory: the offloaded optimizer allocates less than 1 % of the parameters' bytes on the GPU
   over its steps, where torch AdamW allocates its two moments (2 x the parameters);
4. step times of both (reported, always pass).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainers"))

SHAPES = [(4096, 2048)] * 8 + [(32, 1536, 2048)] * 2  # attention-like and fused-expert-like: 268 M
STEPS, LR, TOLERANCE = 5, 1e-3, 2e-5


def params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in SHAPES]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(1000 + step)
    return [torch.randn(s, device="cuda", generator=g) * 1e-3 for s in SHAPES]


def run(opt_cls, **kw) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, int, float]:
    ps = params(0)
    opt = opt_cls(ps, lr=LR, weight_decay=0.0, **kw)
    every = [grads(step) for step in range(STEPS)]  # made before measuring: only the optimizer counts
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for step in range(STEPS):
        for p, g in zip(ps, every[step], strict=True):
            p.grad = g
        opt.step()
        for p in ps:
            p.grad = None
    torch.cuda.synchronize()
    return ps, opt, torch.cuda.max_memory_allocated() - before, (time.perf_counter() - t0) / STEPS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/grpo-operator/torch_extensions"))
    from grpo_trainer.offload import CPUOffloadAdamW

    param_bytes = sum(torch.Size(s).numel() * 4 for s in SHAPES)
    ref, ref_opt, ref_extra, ref_s = run(torch.optim.AdamW, foreach=False)
    ref = [p.detach().cpu() for p in ref]
    del ref_opt
    torch.cuda.empty_cache()
    got, opt, off_extra, off_s = run(CPUOffloadAdamW)
    diff = max(float((p.detach().cpu() - r).abs().max()) for p, r in zip(got, ref, strict=True))
    states = list(opt.state.values())
    moments = [s[k] for s in states for k in ("exp_avg", "exp_avg_sq")]
    host = all(m.device.type == "cpu" and m.is_pinned() for m in moments)
    masters = all(m.device.type == "cpu" and m.is_pinned() for m in opt._masters.values())
    steps = {float(s["step"]) for s in states}
    results = [
        {"part": "same_parameters_as_torch_adamw", "max_abs_diff": diff, "tolerance": TOLERANCE,
         "pass": diff <= TOLERANCE},
        {"part": "state_in_pinned_host_memory", "moments_pinned": host, "masters_pinned": masters,
         "masters": len(opt._masters), "steps": sorted(steps),
         "pass": host and masters and len(opt._masters) == len(SHAPES) and steps == {float(STEPS)}},
        {"part": "gpu_memory", "param_mib": param_bytes / 2**20, "torch_adamw_extra_mib": ref_extra / 2**20,
         "offload_extra_mib": off_extra / 2**20, "pass": off_extra < 0.01 * param_bytes <= ref_extra},
        {"part": "step_seconds", "torch_adamw_gpu": ref_s, "deepspeed_cpu_adam": off_s, "pass": True},
    ]  # fmt: skip
    for r in results:
        print(json.dumps(r))
    if args.json:
        report = {"device": torch.cuda.get_device_name(), "results": results}
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
