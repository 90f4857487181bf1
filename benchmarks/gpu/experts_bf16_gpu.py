"""Prepared GPU check of the training dtype path of the experts (one H100/H200; about a minute).

Run from the repository root: `python benchmarks/gpu/experts_bf16_gpu.py --json $OUT/experts_bf16.json`;
exit status 0 when every check passes, 1 otherwise. Not run in CI (no GPU there).

At Qwen3-30B-A3B-like shapes (H 2048, I 768, 128 experts of which 16 local, top-8, skewed
routing with empty experts), fp32 master weights and gradients:
1. `torch._grouped_mm` is taken: bf16 rows on CUDA go through `_grouped_mm_swiglu`.
2. Forward and backward of `GroupedExperts` on bf16 rows (weights cast from fp32 by the
   module, as under FSDP2 mixed precision / autocast) against the same computation in fp64 on
   the GPU: relative error of the output and of every gradient (rows, routing weights,
   gate_up, down) below `TOLERANCE` (relative Frobenius norm; bf16 has 8 bits of mantissa).
3. The fp32 per-segment path agrees with the fp64 reference to `FP32_TOLERANCE`.
4. MoELayer under `torch.autocast(bf16)`: the rows reaching the experts are bf16.
5. bf16 grouped forward+backward time against the fp32 per-segment path (reported; pass when
   bf16 is faster, the reason the path exists).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainers"))

HIDDEN, INTER, LOCAL, TOP_K, TOKENS = 2048, 768, 16, 8, 4096
TOLERANCE = 2e-2  # bf16 relative error, output and gradients
FP32_TOLERANCE = 1e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def make_inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = TOKENS * TOP_K // 8  # rows landing on this rank's 16 experts (EP 8)
    skew = torch.rand(LOCAL, device="cuda", generator=g) ** 3
    skew[[3, 11]] = 0  # empty experts
    counts = (skew / skew.sum() * rows).floor().long()
    counts[0] += rows - int(counts.sum())
    x = torch.randn(rows, HIDDEN, device="cuda", generator=g)
    w = torch.rand(rows, device="cuda", generator=g)
    gate_up = torch.randn(LOCAL, 2 * INTER, HIDDEN, device="cuda", generator=g) / HIDDEN**0.5
    down = torch.randn(LOCAL, HIDDEN, INTER, device="cuda", generator=g) / INTER**0.5
    return x, w, gate_up, down, counts.tolist()


def check_accuracy() -> dict:
    from grpo_trainer.moe import experts as ex

    x, w, gate_up, down, counts = make_inputs()
    module = ex.GroupedExperts(gate_up.clone(), down.clone(), num_experts=LOCAL)  # fp32 master weights
    probe = torch.randn(x.shape[0], HIDDEN, device="cuda")
    called = []
    original = ex._grouped_mm_swiglu
    ex._grouped_mm_swiglu = lambda *a: called.append(1) or original(*a)
    try:
        xb = x.bfloat16().requires_grad_(True)
        wb = w.bfloat16().requires_grad_(True)
        out = module(xb, counts, wb)
        (out.float() * probe).sum().backward()
    finally:
        ex._grouped_mm_swiglu = original
    ref = [t.double().requires_grad_(True) for t in (x, w, gate_up, down)]
    expected = ex._SegmentSwiGLU.apply(*ref, counts)
    (expected * probe.double()).sum().backward()
    errors = {
        "output": rel(out, expected),
        "grad_rows": rel(xb.grad, ref[0].grad),
        "grad_weights": rel(wb.grad, ref[1].grad),
        "grad_gate_up": rel(module.gate_up_proj.grad, ref[2].grad),
        "grad_down": rel(module.down_proj.grad, ref[3].grad),
    }
    f32 = [t.clone().requires_grad_(True) for t in (x, w, gate_up, down)]
    out32 = ex._SegmentSwiGLU.apply(*f32, counts)
    fp32_error = rel(out32, expected)
    ok = bool(called) and all(e < TOLERANCE for e in errors.values()) and fp32_error < FP32_TOLERANCE
    ok = ok and module.gate_up_proj.grad.dtype == torch.float32 and out.dtype == torch.bfloat16
    return {
        "part": "bf16_accuracy",
        "grouped_mm_used": bool(called),
        "relative_errors": errors,
        "fp32_segment_error": fp32_error,
        "tolerance": TOLERANCE,
        "pass": ok,
    }


def check_autocast_rows() -> dict:
    from grpo_trainer.moe import GroupedExperts, MoELayer, Router, RouterConfig, make_dispatcher

    cfg = RouterConfig(num_experts=8, top_k=2, score_func="softmax", norm_topk_prob=True)
    experts = GroupedExperts(torch.randn(8, 64, 32), torch.randn(8, 32, 32), num_experts=8)
    layer = MoELayer(Router(cfg, 32), experts, make_dispatcher("local", None, 8)).cuda()
    seen: list[torch.dtype] = []
    experts.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(torch.randn(4, 16, 32, device="cuda"))
    return {"part": "autocast_rows", "rows_dtype": str(seen[0]), "pass": seen == [torch.bfloat16]}


def timing() -> dict:
    from grpo_trainer.moe import experts as ex

    x, w, gate_up, down, counts = make_inputs(1)
    probe = torch.randn(x.shape[0], HIDDEN, device="cuda")

    def run(dtype, fn):
        leaves = [t.to(dtype).requires_grad_(True) for t in (x, w, gate_up, down)]
        (fn(*leaves, counts).float() * probe).sum().backward()

    def seconds(dtype, fn, iters=10):
        for _ in range(2):
            run(dtype, fn)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            run(dtype, fn)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters

    bf16 = seconds(torch.bfloat16, ex.grouped_swiglu)
    fp32 = seconds(torch.float32, ex._SegmentSwiGLU.apply)
    return {
        "part": "timing",
        "bf16_grouped_s": bf16,
        "fp32_segment_s": fp32,
        "speedup": fp32 / bf16,
        "pass": bf16 < fp32,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    results = []
    for part in (check_accuracy, check_autocast_rows, timing):
        try:
            results.append(part())
        except Exception as e:  # record and go on: one broken part must not hide the others
            results.append({"part": part.__name__, "error": repr(e), "pass": False})
    for r in results:
        print(json.dumps(r))
    if args.json:
        args.json.write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=2)
        )
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
