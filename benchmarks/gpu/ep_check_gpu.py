"""Pass/fail GPU check of the EP layer for ONE H100/H200 (bounded to ~6 minutes; never in CI).

Run from the repository root: `python benchmarks/gpu/ep_check_gpu.py --json $OUT/ep_check.json`;
exit status 0 when every check passed or was skipped for a stated reason, 1 otherwise.

What one GPU can check (each a row with its threshold):
1. bf16 matmul peak: >= 450 TFLOP/s on H100/H200 (dense peak ~989), recorded elsewhere.
2. Grouped experts (`torch._grouped_mm` path) vs the per-expert loop, forward and backward at
   Qwen3-30B-A3B-like shapes: same results (bf16 tolerance) and not slower than 0.8x the loop.
3. The `nccl` backend (all-to-all) at world 1 (all_to_all_single on a real NCCL communicator)
   against the `local` reference: bf16 output within tolerance.
4. The training dtype path: fp32 master weights, layer under bf16 autocast, forward+backward vs
   the fp32 layer: output and gradients within bf16 tolerance, masters still fp32.
5. `auto` over NCCL at world 1: the gang-wide measurement runs its NCCL collectives (all-reduce,
   all_gather_object) and chooses `nccl` with a time.
6. DeepEP, only if `deep_ep` imports (not on a bare machine): which APIs the install has, and
   v2 (`ElasticBuffer`) at EP = 1 against `local` (informative: v2's EP = 1 path moves nothing).
What one GPU cannot check: DeepEP v1 intranode needs 2, 4 or 8 NVLink GPUs; DeepEP v2 and NCCL
all-to-all across EFA need two nodes. Commands for those are in docs/deepep-efa.md.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "trainers"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ep_layer_gpu import EXPERTS, HIDDEN, INTER, TOP_K, cuda_time, matmul_peak

TOKENS = 4096
BF16_REL = 3e-2  # relative error bound for one bf16 layer (8-bit mantissa, sums of ~k*I terms)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check(rows: list[dict], name: str, passed: bool | None, **info) -> None:
    """passed None = skipped (with `why` in info)."""
    rows.append({"check": name, "result": {True: "pass", False: "FAIL", None: "skip"}[passed], **info})
    print(rows[-1], flush=True)


def guarded(rows: list[dict], name: str, fn) -> None:
    try:
        fn()
    except Exception:  # a broken part fails its check and the rest still run
        check(rows, name, False, error=traceback.format_exc()[-1200:])


def check_peak(rows: list[dict]) -> float:
    tflops = matmul_peak()["tflops"]
    hopper = any(n in torch.cuda.get_device_name() for n in ("H100", "H200", "H800", "H20"))
    check(rows, "bf16_matmul_peak", tflops >= 450 if hopper else None, tflops=tflops, why="not Hopper")
    return tflops


def check_grouped(rows: list[dict]) -> None:
    from grpo_trainer.moe.experts import _SegmentSwiGLU, grouped_swiglu

    n = TOKENS * TOP_K
    counts = torch.distributions.Multinomial(n, torch.ones(EXPERTS)).sample().long().tolist()
    counts[0], counts[1] = counts[0] + counts[1], 0  # an empty and an overloaded expert
    torch.manual_seed(0)
    x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    results = {}
    for name, fn in {"grouped": grouped_swiglu, "loop": _SegmentSwiGLU.apply}.items():
        leaves = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
        out = fn(*leaves, counts)
        out.float().pow(2).mean().backward()
        results[name] = [out.detach()] + [t.grad for t in leaves]
        step = lambda fn=fn, leaves=leaves: fn(*leaves, counts).sum().backward()  # noqa: E731
        results[name + "_s"] = cuda_time(step, iters=5)
    errs = [rel_err(a, b) for a, b in zip(results["grouped"], results["loop"], strict=True)]
    speed = results["loop_s"] / results["grouped_s"]
    check(rows, "grouped_vs_loop_exact", max(errs) <= BF16_REL, rel_errs=errs, bound=BF16_REL)
    check(rows, "grouped_vs_loop_speed", speed >= 0.8, speedup=speed, bound=0.8)


def layer(backend: str, group, *, dtype: torch.dtype, seed: int = 0):
    from grpo_trainer import moe

    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * 0.02
    router = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen) * 0.02
    return moe.MoELayer(
        moe.Router(moe.RouterConfig(EXPERTS, TOP_K), HIDDEN, torch.nn.Parameter(router.to(dtype))),
        moe.GroupedExperts(gate_up.to(dtype), down.to(dtype), EXPERTS, 0, group),
        moe.make_dispatcher(backend, group, EXPERTS),
    )


def check_alltoall_world1(rows: list[dict]) -> None:
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = layer("local", None, dtype=torch.bfloat16)(x)
        got = layer("nccl", dist.group.WORLD, dtype=torch.bfloat16)(x)
    err = rel_err(got, ref)
    check(rows, "alltoall_nccl_world1_vs_local", err <= 1e-2, rel_err=err, bound=1e-2)


def check_training_dtype(rows: list[dict]) -> None:
    """fp32 masters under bf16 autocast vs the fp32 layer, forward and backward."""
    x = torch.randn(TOKENS, HIDDEN, device="cuda")
    outs = {}
    for name, autocast in (("fp32", False), ("autocast_bf16", True)):
        lay = layer("nccl", dist.group.WORLD, dtype=torch.float32)
        xs = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = lay(xs)
        out.float().pow(2).mean().backward()
        outs[name] = [out.detach(), xs.grad, lay.experts.gate_up_proj.grad, lay.gate.weight.grad]
        assert all(p.dtype == torch.float32 for p in lay.parameters()), "masters stay fp32"
    errs = [rel_err(a, b) for a, b in zip(outs["autocast_bf16"], outs["fp32"], strict=True)]
    check(rows, "bf16_autocast_vs_fp32_fwd_bwd", max(errs) <= BF16_REL, rel_errs=errs, bound=BF16_REL)


def check_auto(rows: list[dict]) -> None:
    from grpo_trainer.moe import autoselect

    shape = autoselect.EPShape(hidden=HIDDEN, top_k=TOP_K, tokens=TOKENS)
    _, selection = autoselect.choose_backend(dist.group.WORLD, EXPERTS, shape, ranks_per_node=1)
    ok = selection.backend == "nccl" and selection.seconds.get("nccl", 0) > 0
    check(rows, "auto_nccl_world1", ok, backend=selection.backend, candidates=selection.summary())


def check_deepep(rows: list[dict]) -> None:
    # the trainer's import of deep_ep and its checks
    from grpo_trainer.moe.backends import deepep_v1, deepep_v2

    apis = {"Buffer": deepep_v1.Buffer is not None, "ElasticBuffer": deepep_v2.AVAILABLE}
    if not any(apis.values()):
        check(rows, "deepep_installed", None, why=f"deep_ep does not import: {deepep_v2.WHY}")
        return
    check(rows, "deepep_installed", True, apis=apis)
    if not apis["ElasticBuffer"]:
        check(rows, "deepep_v2_ep1_vs_local", None, why=f"no ElasticBuffer: {deepep_v2.WHY}")
        return

    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ref = layer("local", None, dtype=torch.bfloat16)
    lay = layer("local", None, dtype=torch.bfloat16)
    lay.dispatcher = deepep_v2.Dispatcher(dist.group.WORLD, EXPERTS)  # EP = 1: informative only
    with torch.no_grad():
        err = rel_err(lay(x), ref(x))
    check(rows, "deepep_v2_ep1_vs_local", err <= BF16_REL, rel_err=err, bound=BF16_REL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path(os.environ.get("OUT", ".")) / "ep_check.json")
    parser.add_argument("--budget-s", type=int, default=360, help="hard wall-clock bound")
    args = parser.parse_args()
    signal.alarm(args.budget_s)  # bounded: a hung collective must not eat the device time
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    rows: list[dict] = [{"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count()}]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(0)
    guarded(rows, "bf16_matmul_peak", lambda: check_peak(rows))
    guarded(rows, "grouped_vs_loop", lambda: check_grouped(rows))
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(  # device_id: the communicator exists before DeepEP v2 reuses it
            "nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
        try:
            for name, fn in (
                ("alltoall_nccl_world1_vs_local", check_alltoall_world1),
                ("bf16_autocast_vs_fp32_fwd_bwd", check_training_dtype),
                ("auto_nccl_world1", check_auto),
                ("deepep", check_deepep),
            ):
                guarded(rows, name, lambda fn=fn: fn(rows))
                args.json.write_text(json.dumps({"rows": rows}, indent=2))  # partial results survive a hang
        finally:
            dist.destroy_process_group()
    failed = [r["check"] for r in rows if r.get("result") == "FAIL"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.json.write_text(json.dumps({"rows": rows, "failed": failed, "date": stamp}, indent=2))
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed or skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
