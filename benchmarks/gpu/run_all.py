"""The one GPU entry script: every GPU path one H100/H200 can show, as one table (under 8 minutes).

Run from the repository root on a lent GPU machine that has only torch and no network, with the
wheelhouse `benchmarks/gpu/wheelhouse.sh` built here (carried as `.whl/`):

    python benchmarks/gpu/run_all.py --wheelhouse .whl --json $OUT/gpu.json

Each section runs in a child process of its own under its own time budget, so a hung collective or
a crash fails that section alone and the others still run. The wheels are unpacked (a wheel is a
zip; no pip, no network) into a temporary site folder put on the children's PYTHONPATH, after the
repository's own sources (operator/, trainers/, rollout/: what is checked out is what runs). The
table: section, status (ok / skipped (reason) / failed (reason)), the number, its bound and the
ratio to it. Without CUDA every section says so. Exit status 1 when a section failed.

Sections call the prepared scripts next to this one: experts_bf16_gpu (bf16 grouped experts against
fp64 and their speed against fp32), ep_layer_gpu (matmul peak, grouped experts as a fraction of
it), ep_check_gpu (the NCCL all-to-all, bf16 autocast and `auto` at world 1; DeepEP where
`deep_ep` imports), and the trainer's own FSDP2 step and Hugging Face export
(`grpo_trainer.checkpoint.export_hf`: each tensor written by a rank that holds it, never the
whole model gathered) on the tiny Qwen3-MoE. What one GPU cannot show (DeepEP intranode on 2-8
NVLink GPUs, anything across EFA nodes, vLLM: rollout_vllm_gpu.py in the rollout image) is not here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SOURCES = [ROOT / "operator", ROOT / "trainers", ROOT / "rollout", HERE]
H100_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM dense bf16 peak (the spec sheet's, no sparsity)
PEAK_BOUND_TFLOPS = 450.0
EXPORT_SLACK_BYTES = 64 << 20  # allocator rounding and the export's small side tensors


@dataclass(frozen=True)
class Section:
    name: str
    budget_s: int  # the child is killed past this; all together 445 s, under the 8 minutes
    modules: tuple[str, ...]  # what it imports (ours and the scripts): the wheelhouse covers their needs
    run: Callable[[], dict]  # -> {"status", "value", "bound", "ratio", "detail"}


def row(ok: bool, value: str, bound: str, ratio: float | None, **detail: object) -> dict:
    return {
        "status": "ok" if ok else "failed (bound not met)",
        "value": value,
        "bound": bound,
        "ratio": ratio,
        "detail": detail,
    }


def matmul_peak() -> dict:
    import ep_layer_gpu

    tflops = ep_layer_gpu.matmul_peak()["tflops"]
    return row(
        tflops >= PEAK_BOUND_TFLOPS,
        f"{tflops:.0f} TFLOP/s",
        f">= {PEAK_BOUND_TFLOPS:.0f} TFLOP/s",
        tflops / PEAK_BOUND_TFLOPS,
        of_dense_peak=tflops / H100_BF16_DENSE_TFLOPS,
    )


def experts_bf16() -> dict:
    import experts_bf16_gpu as eb

    accuracy, rows = eb.check_accuracy(), eb.check_autocast_rows()
    worst = max(accuracy["relative_errors"].values())
    ok = accuracy["pass"] and rows["pass"]
    return row(
        ok, f"rel err {worst:.2e}", f"< {eb.TOLERANCE:g}", worst / eb.TOLERANCE, parts=[accuracy, rows]
    )


def grouped_experts() -> dict:
    import ep_layer_gpu

    peak = ep_layer_gpu.matmul_peak()["tflops"]
    rows = {r["path"]: r for r in ep_layer_gpu.expert_throughput(peak)}
    grouped = rows["grouped_mm"]
    if "error" in grouped:
        raise RuntimeError(grouped["error"])
    speed = grouped["tflops"] / rows["segment_mm"]["tflops"] if "tflops" in rows["segment_mm"] else None
    return row(
        grouped["of_peak"] > 0 and (speed is None or speed >= 0.8),
        f"{grouped['tflops']:.0f} TFLOP/s",
        "vs the matmul peak; >= 0.8x the per-expert loop",
        grouped["of_peak"],
        vs_loop=speed,
    )


def _nccl_world1(checks: Callable[[list[dict]], None]) -> list[dict]:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            checks(rows)
        finally:
            dist.destroy_process_group()
    return rows


def ep_nccl() -> dict:
    import ep_check_gpu as ec

    def checks(rows: list[dict]) -> None:
        for fn in (ec.check_grouped, ec.check_alltoall_world1, ec.check_training_dtype, ec.check_auto):
            ec.guarded(rows, fn.__name__, lambda fn=fn: fn(rows))

    rows = _nccl_world1(checks)
    failed = [r["check"] for r in rows if r["result"] == "FAIL"]
    return row(not failed, f"{len(rows) - len(failed)}/{len(rows)} checks", "all pass", None, rows=rows)


def deepep() -> dict:
    import ep_check_gpu as ec

    rows = _nccl_world1(lambda rows: ec.guarded(rows, "deepep", lambda: ec.check_deepep(rows)))
    failed = [r["check"] for r in rows if r["result"] == "FAIL"]
    return row(
        not failed,
        f"{len(rows) - len(failed)}/{len(rows)} checks",
        "all pass (EP 1: informative)",
        None,
        rows=rows,
    )


def fsdp2_step(device_type: str = "cuda") -> dict:
    import trainer_paths

    seconds, peak = trainer_paths.fsdp2_step(device_type)
    memory = f", peak {peak / 2**20:.0f} MiB" if peak is not None else ""
    return row(True, f"{seconds * 1e3:.1f} ms/step{memory}", "one step runs (FSDP2, AdamW, bf16)", None)


def hf_export(device_type: str = "cuda") -> dict:
    import trainer_paths

    extra, largest, files = trainer_paths.export_growth(device_type)
    bound = largest + EXPORT_SLACK_BYTES
    return row(
        extra <= bound,
        f"+{extra / 2**20:.1f} MiB",
        f"<= largest tensor + {EXPORT_SLACK_BYTES >> 20} MiB",
        extra / bound,
        files=files,
    )


SECTIONS = [
    Section("bf16_matmul_peak", 60, ("ep_layer_gpu",), matmul_peak),
    Section("experts_bf16_vs_fp64", 90, ("experts_bf16_gpu", "grpo_trainer.moe.experts"), experts_bf16),
    Section("grouped_experts_vs_peak", 60, ("ep_layer_gpu", "grpo_trainer.moe.experts"), grouped_experts),
    Section(
        "ep_nccl_world1", 90, ("ep_check_gpu", "grpo_trainer.moe", "grpo_trainer.moe.autoselect"), ep_nccl
    ),
    Section("deepep", 45, ("ep_check_gpu", "grpo_trainer.moe.deepep_v2"), deepep),
    Section("fsdp2_step", 50, ("trainer_paths",), fsdp2_step),
    Section("hf_export_no_gather", 50, ("trainer_paths",), hf_export),
]


def unpack(wheelhouse: Path, site: Path) -> list[str]:
    """Every wheel of `wheelhouse` unpacked into `site` (an install without pip: no scripts)."""
    names = []
    for wheel in sorted(wheelhouse.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        names.append(wheel.name)
    return names


def skip_reason(section: Section) -> str | None:
    """Why a section cannot run here, decided before it starts."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA: no CUDA device visible"
    if section.name == "deepep" and importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not installed (the trainer image builds it)"
    return None


def run_child(section: Section, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--section", section.name, "--row", str(out)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=section.budget_s)
        except subprocess.TimeoutExpired:
            return {"status": f"failed (past its {section.budget_s} s budget)"}
        if out.exists():
            return json.loads(out.read_text())
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"status": f"failed ({tail[0][:160]})"}


def child(name: str, out: Path) -> int:
    section = next(s for s in SECTIONS if s.name == name)
    try:
        for module in section.modules:
            importlib.import_module(module)
        result = section.run()
    except Exception as e:  # the parent reports it in the section's row
        result = {"status": f"failed ({type(e).__name__}: {str(e)[:160]})"}
    out.write_text(json.dumps(result, default=str))
    return 0


def table(rows: list[tuple[str, dict, float]]) -> str:
    lines = [f"{'section':<26} {'status':<44} {'number':<22} {'bound':<40} {'ratio':>6}  seconds"]
    for name, r, seconds in rows:
        ratio = f"{r['ratio']:.2f}" if isinstance(r.get("ratio"), float) else "-"
        lines.append(
            f"{name:<26} {r['status'][:44]:<44} {r.get('value', '-'):<22} {r.get('bound', '-')[:40]:<40} "
            f"{ratio:>6}  {seconds:.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheelhouse", type=Path, help="folder of wheels (wheelhouse.sh); unpacked, not installed"
    )
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # child mode: run one section
    parser.add_argument("--row", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        sys.path[:0] = [str(p) for p in SOURCES]
        return child(args.section, args.row)
    with tempfile.TemporaryDirectory() as site:
        wheels = unpack(args.wheelhouse, Path(site)) if args.wheelhouse else []
        path = [str(p) for p in SOURCES] + [site] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        rows = []
        for section in SECTIONS:
            t0 = time.monotonic()
            reason = skip_reason(section)
            result = {"status": f"skipped ({reason})"} if reason else run_child(section, env)
            rows.append((section.name, result, time.monotonic() - t0))
            print(f"{section.name}: {result['status']}", flush=True)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        args.json.write_text(
            json.dumps({"date": stamp, "wheels": wheels, "rows": rows}, indent=2, default=str)
        )
    return 1 if any(r["status"].startswith("failed") for _, r, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
