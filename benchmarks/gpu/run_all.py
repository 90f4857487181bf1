"""The one GPU entry script: every GPU path one H100/H200 can show, as one table (under 8 minutes).

Run from the repository root on a lent GPU machine that has only torch and no network, with the
wheelhouse `benchmarks/gpu/wheelhouse.sh` built here (carried as `.whl/`):

    python benchmarks/gpu/run_all.py --wheelhouse .whl --json $OUT/gpu.json

Each section runs in a child process of its own under its own time budget, so a hung collective or
a crash fails that section alone and the others still run. The child sets up what the section
needs (`setup`): the CUDA device, and for the sections that use one a default process group of
world 1 (NCCL over a TCP store at MASTER_ADDR/MASTER_PORT, created with `device_id` so its
communicator exists before DeepEP v2 reuses it; gloo where there is no CUDA), torn down after.
The wheels the running Python loads (`wheels.select`: the wheelhouse holds cp311 and cp312 ones)
are unpacked (a wheel is a zip; no pip, no network) into a temporary site folder put on the
children's PYTHONPATH, after the repository's own sources (operator/, trainers/, rollout/: what is
checked out is what runs); a Python below pyproject.toml's floor, or a wheelhouse without its
wheels, is stated in every row. The table: section, status (ok / skipped (reason) / failed
(reason)), the number, its bound and the ratio to it. Without CUDA every section says so. Exit
status 1 when a section failed.

`--setup-only` runs every section's setup and its own steps up to the first that needs CUDA (on a
GPU: up to the measurement), and reports what each reached and where it stopped; the CPU test runs
it.

Sections call the prepared scripts next to this one: experts_bf16_gpu (bf16 grouped experts against
fp64 and their speed against fp32), ep_layer_gpu (matmul peak, grouped experts as a fraction of
it), ep_check_gpu (the NCCL all-to-all, bf16 autocast and `auto` at world 1; DeepEP where
`deep_ep` imports), and the trainer's own FSDP2 step and Hugging Face export
(`grpo_trainer.checkpoint.export_hf`: each tensor written by a rank that holds it, never the
whole model gathered) on the tiny Qwen3-MoE. In the rollout image (vllm and deep_ep installed),
rollout_deepep_in_vllm loads vLLM's plugins in a process whose NCCL communicator exists with the EFA
env, and reports whether DeepEP imported, v2 got its EFA counts, vLLM's deepep_v2 gate passed, and
what the node lacks for NCCL GIN. What one GPU cannot show (DeepEP intranode on 2-8
NVLink GPUs, anything across EFA nodes, vLLM: rollout_vllm_gpu.py in the rollout image) is not here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import wheels  # beside this script, which Python puts first on sys.path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SOURCES = [ROOT / "operator", ROOT / "trainers", ROOT / "rollout", ROOT / "wire", HERE]
H100_BF16_DENSE_TFLOPS = 989.0  # H100/H200 SXM dense bf16 peak (the spec sheet's, no sparsity)
PEAK_BOUND_TFLOPS = 450.0
EXPORT_SLACK_BYTES = 64 << 20  # allocator rounding and the export's small side tensors


class Stop(Exception):
    """Where a `--setup-only` run of a section stops: the first step this machine cannot take."""


def cuda_point(reached: list[str]) -> None:
    """The sections whose first step after setup is CUDA work (kernels, the CUDA allocator)."""
    import torch

    if not torch.cuda.is_available():
        raise Stop("needs CUDA: its first step runs CUDA kernels")


@dataclass(frozen=True)
class Section:
    name: str
    budget_s: int  # the child is killed past this; all together 475 s, under the 8 minutes
    modules: tuple[str, ...]  # what it imports (ours and the scripts): the wheelhouse covers their needs
    run: Callable[[], dict]  # -> {"status", "value", "bound", "ratio", "detail"}
    group: bool = False  # runs in a default process group of world 1 that `setup` makes
    ready: Callable[[list[str]], None] = cuda_point  # its steps before CUDA work (--setup-only)
    env: tuple[tuple[str, str], ...] = ()  # set in its child before `setup` (NCCL reads it at its first init)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def setup(section: Section, reached: list[str]) -> Iterator[None]:
    """What `section` needs in this (child) process, torn down after; `reached` records each step.
    The group is NCCL with `device_id`, so its communicator exists at once (DeepEP v2 reuses it and
    refuses a group whose `_comm_ptr()` is still 0); gloo where there is no CUDA."""
    import torch
    import torch.distributed as dist

    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0"}
    os.environ.update(env, WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")  # layout_of reads LOCAL_WORLD_SIZE
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    reached.append(f"device cuda:0 ({torch.cuda.get_device_name(0)})" if cuda else "device cpu (no CUDA)")
    if section.group:
        backend, device = ("nccl", torch.device("cuda", 0)) if cuda else ("gloo", None)
        dist.init_process_group(backend, init_method="env://", rank=0, world_size=1, device_id=device)
        reached.append(f"process group {backend} world {dist.get_world_size()} at 127.0.0.1:{port}")
    try:
        yield
    finally:
        if section.group and dist.is_initialized():
            dist.destroy_process_group()
            reached.append("process group destroyed")


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


def ep_nccl() -> dict:
    import ep_check_gpu as ec

    rows: list[dict] = []
    for fn in (ec.check_grouped, ec.check_alltoall_world1, ec.check_training_dtype, ec.check_auto):
        ec.guarded(rows, fn.__name__, lambda fn=fn: fn(rows))
    failed = [r["check"] for r in rows if r["result"] == "FAIL"]
    return row(not failed, f"{len(rows) - len(failed)}/{len(rows)} checks", "all pass", None, rows=rows)


def ep_nccl_ready(reached: list[str]) -> None:
    """The all-to-all dispatcher over the section's group; NCCL is the CUDA need."""
    import torch.distributed as dist
    from ep_layer_gpu import EXPERTS
    from grpo_trainer import moe

    runs_on = dist.get_backend()  # the all-to-all backend of the group's own kind (gloo off a GPU)
    dispatcher = moe.make_dispatcher(runs_on if runs_on == "gloo" else "nccl", dist.group.WORLD, EXPERTS)
    reached.append(f"{dispatcher.name} dispatcher of {EXPERTS} experts over the default group")
    if runs_on != "nccl":
        raise Stop(f"needs CUDA: the all-to-all is checked over NCCL, this group is {runs_on}")


def deepep_gate() -> str | None:
    """DeepEP v2's own refusal (`deepep_v2.requires`) for this install and device, asked of a group
    across two nodes: the one rank here spans none, so EP 1 is measured as information only."""
    import torch.distributed as dist
    from ep_layer_gpu import EXPERTS
    from grpo_trainer.moe import autoselect
    from grpo_trainer.moe.backends import deepep_v2

    layout = autoselect.layout_of(dist.group.WORLD)
    return deepep_v2.requires(dataclasses.replace(layout, ranks=(0, 1), ranks_per_node=1), EXPERTS)


def deepep() -> dict:
    import ep_check_gpu as ec

    why = deepep_gate()
    if why:
        return {"status": f"skipped ({why})"}
    rows: list[dict] = []
    ec.guarded(rows, "deepep", lambda: ec.check_deepep(rows))
    failed = [r["check"] for r in rows if r["result"] == "FAIL"]
    return row(
        not failed,
        f"{len(rows) - len(failed)}/{len(rows)} checks",
        "all pass (EP 1: informative)",
        None,
        rows=rows,
    )


def deepep_ready(reached: list[str]) -> None:
    """Up to DeepEP v2's buffer: its gate, its dispatcher, the communicator it will reuse."""
    import torch.distributed as dist
    from ep_layer_gpu import EXPERTS
    from grpo_trainer.moe import deepep
    from grpo_trainer.moe.backends import deepep_v2

    why = deepep_gate()
    reached.append(f"deepep_v2 gate over a {dist.get_backend()} group: {why or 'serves'}")
    if why:
        raise Stop(f"DeepEP v2 refused: {why}")
    dispatcher = deepep_v2.Dispatcher(dist.group.WORLD, EXPERTS)
    deepep.check_communicator(dispatcher.group)
    reached.append("deepep_v2 dispatcher built; the group's NCCL communicator exists")


# A rollout server spanning EFA nodes, as the operator renders it: the resolved backend the plugin reads
# and the EFA/GIN env of every EFA pod (grpo_operator.render.pods). NCCL loads the net plugin named here
# when `setup` makes the group's communicator, before vLLM's plugin runs, as in a vLLM worker.
ROLLOUT_EFA_ENV = (
    ("GRPO_VLLM_ALL2ALL", "deepep_v2"),
    ("FI_PROVIDER", "efa"),
    ("NCCL_NET_PLUGIN", "ofi"),
    ("NCCL_GIN_PLUGIN", "ofi"),
    ("NCCL_GIN_TYPE", "2"),
)


def rollout_image_facts() -> dict:
    """What this pod's node gives NCCL GIN (grpo_wire.efa) and which NCCL files are mapped."""
    from pathlib import Path as P

    from grpo_wire import efa
    from grpo_wire.deepep_import import nccl_files

    facts = efa.probe()
    runtimes, plugins = nccl_files(P("/proc/self/maps").read_text())
    return {
        "gin_missing": efa.gin_problems(facts),
        "memlock_problem": efa.memlock_problems(facts),
        "efa_devices": facts.rdma_devices,
        "nccl_runtimes": sorted(runtimes),
        "nccl_plugins": sorted(plugins),
    }


def rollout_deepep() -> dict:
    """DeepEP inside a vLLM process (the rollout image): vLLM's own plugin loader runs ours after this
    process's NCCL communicator exists, DeepEP imports, v2 carries the EFA counts, and vLLM's own
    deepep_v2 gate passes. vLLM's deepep_v2 all2all serving inside one node is rollout_vllm_gpu.py's
    check 8 (it needs 2+ GPUs)."""
    import vllm.plugins
    from grpo_wire import efa
    from vllm.utils import import_utils

    vllm.plugins.load_general_plugins()
    import deep_ep

    cls = deep_ep.ElasticBuffer
    gate = import_utils.deep_ep_v2_unavailable_reason()
    installed = bool(getattr(cls, "grpo_efa", False))
    counts = efa.deepep_counts(os.environ)
    facts = rollout_image_facts()
    gin = "GIN ready" if not facts["gin_missing"] else f"GIN lacks {len(facts['gin_missing'])}"
    return row(
        installed and gate is None,
        f"plugin {'on' if installed else 'OFF'}; {gin}",
        "EFA buffer installed, vLLM gate passes",
        None,
        vllm_gate=gate or "passes",
        sms_qps=counts,
        **facts,
    )


def rollout_deepep_ready(reached: list[str]) -> None:
    """Up to vLLM: what is installed, and this node's GIN facts (informative off a GPU node)."""
    found = {m: importlib.util.find_spec(m) is not None for m in ("vllm", "deep_ep")}
    reached.append("installed: " + ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in found.items()))
    facts = rollout_image_facts()
    reached.append(
        f"GIN lacks {len(facts['gin_missing'])}; memlock {'ok' if not facts['memlock_problem'] else 'low'}"
    )
    raise Stop("needs CUDA and the rollout image (vllm and deep_ep)")


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
        "ep_nccl_world1",
        90,
        ("ep_check_gpu", "grpo_trainer.moe", "grpo_trainer.moe.autoselect"),
        ep_nccl,
        group=True,
        ready=ep_nccl_ready,
    ),
    Section(
        "deepep",
        45,
        ("ep_check_gpu", "grpo_trainer.moe.backends.deepep_v2"),
        deepep,
        group=True,
        ready=deepep_ready,
    ),
    Section(
        "rollout_deepep_in_vllm",
        30,
        ("grpo_wire.efa", "grpo_wire.deepep_import"),
        rollout_deepep,
        group=True,
        ready=rollout_deepep_ready,
        env=ROLLOUT_EFA_ENV,
    ),
    Section("fsdp2_step", 50, ("trainer_paths",), fsdp2_step),  # trainer_paths makes the trainer's own group
    Section("hf_export_no_gather", 50, ("trainer_paths",), hf_export),
]


def unpack(wheelhouse: Path, site: Path) -> tuple[list[str], list[str]]:
    """The wheels of `wheelhouse` this Python loads, unpacked into `site` (an install without pip:
    no scripts), and the distributions that have none for it."""
    chosen, missing = wheels.select([w.name for w in wheelhouse.glob("*.whl")], wheels.this_python())
    for name in chosen:
        with zipfile.ZipFile(wheelhouse / name) as z:
            z.extractall(site)
    return chosen, missing


def wheels_problem(missing: list[str]) -> str | None:
    """Why no section can run on this Python for want of wheels (`missing`: distributions without one)."""
    if not missing:
        return None
    v = "{}.{}".format(*wheels.this_python())
    return f"the wheelhouse has no Python {v} wheel of {', '.join(missing)}: rebuild it (wheelhouse.sh)"


def skip_reason(section: Section) -> str | None:
    """Why a section cannot run here, decided before it starts."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA: no CUDA device visible"
    if section.name == "deepep" and importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not installed (the trainer image builds it)"
    if section.name == "rollout_deepep_in_vllm":
        lacking = [m for m in ("vllm", "deep_ep") if importlib.util.find_spec(m) is None]
        if lacking:
            return f"{' and '.join(lacking)} not installed: run it in the rollout image"
    return None


def run_child(section: Section, env: dict[str, str], setup_only: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--section", section.name, "--row", str(out)]
        cmd += ["--setup-only"] if setup_only else []
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=section.budget_s)
        except subprocess.TimeoutExpired:
            return {"status": f"failed (past its {section.budget_s} s budget)"}
        if out.exists():
            return json.loads(out.read_text())
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"status": f"failed ({tail[0][:160]})"}


def ready_row(section: Section, reached: list[str]) -> dict:
    """A `--setup-only` row: "ready" (a GPU machine: all set for the measurement), or where it stopped."""
    try:
        section.ready(reached)
    except Stop as e:
        return {"status": f"ready up to: {e}", "stop": str(e)}
    return {"status": "ready"}


def child(name: str, out: Path, setup_only: bool) -> int:
    section = next(s for s in SECTIONS if s.name == name)
    reached: list[str] = []
    try:
        for module in section.modules:
            importlib.import_module(module)
        reached.append("imported " + ", ".join(section.modules))
        os.environ.update(dict(section.env))
        with setup(section, reached):
            result = ready_row(section, reached) if setup_only else section.run()
    except Exception as e:  # the parent reports it in the section's row
        result = {"status": f"failed ({type(e).__name__}: {str(e)[:160]})"}
    result.setdefault("detail", {})["setup"] = reached  # after the teardown: it is recorded too
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


def run_sections(
    env: dict[str, str], setup_only: bool, python_why: str | None
) -> list[tuple[str, dict, float]]:
    rows = []
    for section in SECTIONS:
        t0 = time.monotonic()
        reason = python_why or (None if setup_only else skip_reason(section))
        result = {"status": f"skipped ({reason})"} if reason else run_child(section, env, setup_only)
        rows.append((section.name, result, time.monotonic() - t0))
        print(f"{section.name}: {result['status']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--wheelhouse", type=Path, help="folder of wheels (wheelhouse.sh); unpacked, not installed"
    )
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--setup-only", action="store_true", help="every section up to its CUDA work")
    parser.add_argument("--section", help=argparse.SUPPRESS)  # child mode: run one section
    parser.add_argument("--row", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.section:
        sys.path[:0] = [str(p) for p in SOURCES]
        return child(args.section, args.row, args.setup_only)
    with tempfile.TemporaryDirectory() as site:
        floor = wheels.floor_problem(wheels.this_python(), wheels.python_floor())
        unpacked, missing = unpack(args.wheelhouse, Path(site)) if args.wheelhouse and not floor else ([], [])
        python_why = floor or wheels_problem(missing)
        print(f"python {sys.version.split()[0]}: {len(unpacked)} wheels unpacked; {python_why or 'served'}")
        path = [str(p) for p in SOURCES] + [site] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        rows = run_sections(env, args.setup_only, python_why)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record = {"date": stamp, "python": sys.version.split()[0], "wheels": unpacked, "rows": rows}
        args.json.write_text(json.dumps(record, indent=2, default=str))
    return 1 if any(r["status"].startswith("failed") for _, r, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
