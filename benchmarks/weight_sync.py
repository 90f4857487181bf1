"""Benchmark: one weight version from 2 trainer ranks to 2 rollout servers, per transport, against
the raw bandwidth of that transport measured in the same run.

Run: `python benchmarks/weight_sync.py --json sync.json` (1 GiB in bf16, about a minute on 2
cores), `--model-mib 64` for a quick look. What runs, all as separate processes on loopback:
- 2 trainer ranks, each holding its half of every tensor in fp32 (FSDP-style row shards), so
  the model is 2 x the payload in training state;
- 2 real rollout servers (`grpo_rollout.server` + `RolloutService`, the code a pod runs) with a
  sink engine that applies updates into preallocated bf16 tensors the way the torch engine does,
  large pieces received in place (no model to generate with: only the transfer is measured);
- 2 raw receivers for the link measurements.
Transports (each timed after one warm-up version, end to end: until every server answers live;
the collective stream --repeats times (5), each right after a link measurement, and the row shows the
version whose share of its own link is the median: pairs cancel the slow swings of a shared
machine's load, the median the spikes that hit one side of a pair):
- collective: every rank streams its shard, converted to bf16 bucket by bucket
  (`grpo_trainer.weight_sync.StreamSender`, the trainer's code), the servers told over
  `/weights/stream`. Link: each rank broadcasts its share as one uint8 tensor, same groups shape.
- http: the pre-existing path: rank 1 sends its shards to rank 0 (gloo), rank 0 converts the
  whole model to bf16, `bucketize`s it and POSTs every bucket to each server. Link: rank 0 POSTs
  the same bytes, bucket-sized, to a plain aiohttp sink on each raw receiver.
The sweep (--only sweep): one server fed by 1, 2, 4, 8 trainer ranks, its reserve against the
plan's. The held leg (--only held): --held-servers servers of one EP member each, keeping the
experts vLLM's linear placement gives its EP rank, fed by the trainer ranks: received / held bytes
per member, next to what it took when every member got the whole model (whole / held).
peak_extra_bytes_per_rank: the most any trainer rank's resident memory rose during the sync
(VmHWM, reset through /proc/self/clear_refs just before; for the collective transport the most
any version added: the first, whose buffers are kept for the next), next to the bucket size.
The table prints each transport's share of its link ("of link") and the machine's load average:
on a shared machine both move with what else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("trainers", "operator", "rollout", "wire"):
    sys.path.insert(0, str(ROOT / sub))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from grpo_operator.api.roles import WeightSync  # noqa: E402

TOKEN = "weight-sync-bench"
COLS = 4096
TENSORS = 32
SENDERS, SERVERS = 2, 2
REPEATS = 5  # measured collective versions, each after a measured link (--repeats)
FAILED_EXIT = 3  # a benchmark that could not finish: which process failed and why is printed


def stream_versions(repeats: int) -> range:
    """The collective leg's versions: version 1 is its warm-up."""
    return range(1, 2 + repeats)


def http_versions(repeats: int) -> tuple[int, int]:
    """The http leg's two versions (a warm-up and the measured one) come after the collective
    leg's: a server refuses a version older than its live one."""
    last = stream_versions(repeats)[-1]
    return last + 1, last + 2


def shapes(model_bytes: int) -> dict[str, list[int]]:
    rows = model_bytes // 2 // COLS // TENSORS  # bf16 on the wire
    rows -= rows % SENDERS
    return {f"layers.{i}.weight": [rows, COLS] for i in range(TENSORS)}


def rss_now() -> int:
    return _status("VmRSS")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakRss:
    """Resident-memory growth over a block: VmHWM reset before, read after."""

    def __enter__(self) -> PeakRss:
        Path("/proc/self/clear_refs").write_text("5")
        self.before = rss_now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.extra = _status("VmHWM") - self.before


def store(port: int, master: bool = False) -> dist.TCPStore:
    t = datetime.timedelta(seconds=600)
    return dist.TCPStore("127.0.0.1", port, is_master=master, timeout=t, wait_for_workers=False)


# --- rollout server with a sink engine ------------------------------------------------------


class SinkEngine:
    """Applies weight updates into preallocated bf16 tensors, as the torch engine copies into its
    model; generates nothing."""

    name = "sink"

    def __init__(self, config) -> None:
        spec = json.loads(os.environ["BENCH_SHAPES"])
        # touched now: a version's resident growth is then the receiver's own buffers alone
        self.targets = {k: torch.empty(v, dtype=torch.bfloat16).fill_(0) for k, v in spec.items()}
        self.report = os.environ.get("BENCH_REPORT")  # the sweep: what each version cost this member
        self.versions: list[dict] = []
        self.received = 0
        held = os.environ.get("BENCH_HELD")  # the held leg: the routed experts this server keeps
        self.held_experts = json.loads(held) if held else None
        self.expert_tensors = frozenset(k for k in spec if ".experts." in k)

    def generate(self, *a, **k):
        raise ValueError("the benchmark's sink engine does not generate")

    def load_weights(self, buckets) -> int:
        from safetensors.torch import load

        n = 0
        for data in buckets:
            for k, v in load(data).items():
                self.targets[k].copy_(v)
                n += 1
        return n

    def begin_update(self, tensors) -> None:
        self.received = 0
        if self.report:
            Path("/proc/self/clear_refs").write_text("5")
            self.rss_before = rss_now()

    def destination(self, name, start, count, dtype, device):
        target = self.targets[name]
        if target.dtype != dtype or self.report:  # the sweep: every byte through the member's buffers
            return None
        self.received += count * target.element_size()
        return target.view(-1)[start : start + count].view(torch.uint8)

    def load_bucket(self, pieces) -> None:
        for name, start, values in pieces:
            self.targets[name].view(-1)[start : start + values.numel()].copy_(values)
            self.received += values.numel() * values.element_size()

    def finish_update(self) -> int:
        if self.report:
            extra = _status("VmHWM") - self.rss_before
            held = self.held_bytes()
            self.versions.append({"extra_rss": extra, "received": self.received, "held": held})
            Path(self.report).write_text(json.dumps(self.versions))
        return len(self.targets)

    def abort_update(self) -> None:
        pass

    def held_bytes(self) -> int:
        """What this server keeps: the whole model, or its experts' rows of the expert tensors."""
        from grpo_wire.holdings import Holding

        holding = Holding(None if self.held_experts is None else tuple(self.held_experts))
        ranges = {k: holding.ranges(k, list(t.shape), self.expert_tensors) for k, t in self.targets.items()}
        return sum((hi - lo) * self.targets[k].element_size() for k, rs in ranges.items() for lo, hi in rs)


def run_server(port: int, tokenizer_dir: str) -> None:
    from grpo_operator.api.spec import RewardSpec
    from grpo_rollout.engines.base import ENGINES, EngineConfig
    from grpo_rollout.server import serve
    from grpo_rollout.service import RolloutService, ServiceConfig

    ENGINES.register("sink")(SinkEngine)
    reward = RewardSpec.model_validate({"functions": [{"builtin": "exact_match"}]})
    config = ServiceConfig(
        f"bench-{port}", "sink", EngineConfig(model_path=tokenizer_dir), reward, drain_seconds=1
    )
    asyncio.run(serve(RolloutService(config), TOKEN, "127.0.0.1", port))


# --- raw receiver: plain gloo broadcast and a plain HTTP sink --------------------------------


def run_raw(index: int, store_port: int, http_port: int, share_bytes: int, link_runs: int) -> None:
    from aiohttp import web
    from grpo_wire import weight_stream

    tcp = store(store_port)
    groups = [
        weight_stream.make_group(dist.PrefixStore(f"raw/{s}", tcp), 1 + index, 1 + SERVERS, "gloo", 600)
        for s in range(SENDERS)
    ]
    bufs = [torch.empty(share_bytes, dtype=torch.uint8) for _ in groups]
    opts = dist.BroadcastOptions()
    for _ in range(link_runs):  # a warm-up, then one before each measured version
        works = [g.broadcast([b], opts) for g, b in zip(groups, bufs, strict=True)]
        for w in works:
            w.wait()
    del bufs

    async def sink(request: web.Request) -> web.Response:
        async for _ in request.content.iter_chunked(1 << 20):
            pass
        return web.Response(text="ok")

    app = web.Application(client_max_size=4 << 30)
    app.router.add_post("/sink", sink)
    web.run_app(app, host="127.0.0.1", port=http_port, print=None, handle_signals=True)


# --- trainer ranks ---------------------------------------------------------------------------


def run_rank(rank: int, args: argparse.Namespace) -> None:
    from grpo_trainer.weight_sync import StreamSender
    from grpo_wire import weight_stream

    torch.set_num_threads(1)
    spec = shapes(args.model_bytes)
    rows = next(iter(spec.values()))[0] // SENDERS
    g = torch.Generator().manual_seed(rank)
    shard = {k: torch.randn(rows, COLS, generator=g) for k in spec}  # this rank's fp32 training state
    ctl = store(args.store_port)
    share_bytes = args.model_bytes_exact // SENDERS
    out: dict = {}

    # 1. raw gloo broadcast: this rank's share as one tensor, to both raw receivers (a warm-up,
    # then once before each measured version); 2. the collective stream, as the trainer does it
    # (rank 0 hosts the store the servers join); memory: the most any version added (the first,
    # whose buffers are kept for the next)
    raw = weight_stream.make_group(dist.PrefixStore(f"raw/{rank}", ctl), 0, 1 + SERVERS, "gloo", 600)
    sender = StreamSender("127.0.0.1", args.sync_port, rank, world=SENDERS, timeout_s=600)
    items = [(k, rank * t.numel(), t.view(-1)) for k, t in shard.items()]
    out.update(raw_s=[], stream_s=[], waited_s=[], filled_s=[], stream_peak_rss=0)
    for version in stream_versions(args.repeats):
        link_s = _raw_broadcast(raw, ctl, share_bytes)
        out["raw_s"] += [link_s] if version > 1 else []  # the first is the link's warm-up
        ctl.add(f"link-{version}-done", 1)
        ctl.wait([f"stream-{version}"])
        with PeakRss() as peak:
            t0 = time.perf_counter()
            stats = sender.send(iter(items), epoch=7, members=SERVERS, backend="gloo", dtype=torch.bfloat16,
                                bucket_bytes=args.bucket_bytes, device=torch.device("cpu"))  # fmt: skip
            seconds = time.perf_counter() - t0
        out["stream_peak_rss"] = max(out["stream_peak_rss"], peak.extra)
        if version > 1:
            out["stream_s"].append(seconds)
            out["waited_s"].append(stats.waited_s)
            out["filled_s"].append(stats.filled_s)
        ctl.add(f"stream-{version}-sent", 1)
    out["stream_tracked"] = stats.peak_bytes
    del raw

    if args.only == "collective":
        ctl.set(f"result-{rank}", json.dumps(out))
        return

    # 3. HTTP as before: gather to rank 0, bucketize, POST to each server
    world = weight_stream.make_group(dist.PrefixStore("world", ctl), rank, SENDERS, "gloo", 600)
    for version in http_versions(args.repeats):
        ctl.wait([f"http-{version}"])
        with PeakRss() as peak:
            t0 = time.perf_counter()
            if rank == 0:
                asyncio.run(_http_push(shard, world, args, version))
            else:
                for t in shard.values():
                    world.send([t], 0, 0).wait()
            out["http_s"] = time.perf_counter() - t0
        out["http_peak_rss"] = peak.extra
        ctl.add(f"http-{version}-done", 1)

    # 4. raw HTTP: the same bytes, bucket-sized POSTs, to a plain sink on each raw receiver
    if rank == 0:
        ctl.wait(["rawhttp"])
        t0 = time.perf_counter()
        asyncio.run(_raw_post(args))
        out["rawhttp_s"] = time.perf_counter() - t0
    ctl.set(f"result-{rank}", json.dumps(out))


def _raw_broadcast(raw: dist.ProcessGroup, ctl: dist.TCPStore, share_bytes: int) -> float:
    """Seconds for this rank's share as one broadcast, started with the other rank's."""
    buf = torch.ones(share_bytes, dtype=torch.uint8)  # touched before the clock starts
    ctl.add("raw-ready", 1)
    while int(ctl.get("raw-ready")) % SENDERS:
        time.sleep(0.001)
    t0 = time.perf_counter()
    raw.broadcast([buf], dist.BroadcastOptions()).wait()
    return time.perf_counter() - t0


async def _http_push(shard: dict, world, args: argparse.Namespace, version: int) -> None:
    from grpo_wire.client import RolloutClient, bucketize

    full = {}
    for k, mine in shard.items():  # one tensor at a time, converted at once (the trainer's HTTP path)
        other = torch.empty_like(mine)
        world.recv([other], 1, 0).wait()
        full[k] = torch.cat([mine, other]).to(torch.bfloat16)
        del other
    buckets = bucketize(full, args.bucket_bytes)
    del full
    async with RolloutClient(args.servers, TOKEN, weights_timeout_s=600) as client:
        await client.push_weights(buckets, version, require_all=True)


async def _raw_post(args: argparse.Namespace) -> None:
    import aiohttp

    body = b"\1" * args.bucket_bytes
    count = -(-args.model_bytes_exact // args.bucket_bytes)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(url: str) -> None:
            for _ in range(count):
                async with http.post(f"{url}/sink", data=body) as resp:
                    await resp.read()

        await asyncio.gather(*(one(u) for u in args.raw_urls))


# --- the sweep: trainer ranks against one member's reserve ----------------------------------

SWEEP_VERSIONS = (1, 2)  # the first allocates what a member keeps, the second reuses it
SWEEP_EPOCH = 11


def sweep_shapes(args: argparse.Namespace) -> dict[str, list[int]]:
    rows = (args.sweep_mib << 20) // 2 // COLS // TENSORS
    rows -= rows % 8  # every sender count of the sweep splits the rows evenly
    return {f"layers.{i}.weight": [rows, COLS] for i in range(TENSORS)}


def run_sweep_rank(rank: int, args: argparse.Namespace) -> None:
    from grpo_trainer.weight_sync import StreamSender

    torch.set_num_threads(1)
    spec, world = sweep_shapes(args), args.senders
    rows = next(iter(spec.values()))[0] // world
    g = torch.Generator().manual_seed(rank)
    shard = {k: torch.randn(rows, COLS, generator=g) for k in spec}
    ctl = store(args.store_port)
    sender = StreamSender("127.0.0.1", args.sync_port, rank, world=world, timeout_s=600)
    items = [(k, rank * t.numel(), t.view(-1)) for k, t in shard.items()]
    peaks = []
    for version in SWEEP_VERSIONS:
        ctl.wait([f"sweep-{version}"])
        stats = sender.send(iter(items), epoch=SWEEP_EPOCH, members=1, backend="gloo", dtype=torch.bfloat16,
                            bucket_bytes=args.sweep_bucket_mib << 20, device=torch.device("cpu"))  # fmt: skip
        peaks.append(stats.peak_bytes)
        ctl.add(f"sweep-{version}-sent", 1)
    ctl.set(f"sweep-result-{rank}", json.dumps({"peak": max(peaks)}))


def sweep(args: argparse.Namespace) -> list[dict]:
    """One server (one member) fed by 1, 2, 4, 8 trainer ranks: what it keeps for streams, what it
    receives against what it holds, what each rank's relay holds. The law: flat in the senders."""
    from grpo_operator.api.roles import NCCL_COMM_BYTES, stream_receive_reserve

    spec = sweep_shapes(args)
    bucket = args.sweep_bucket_mib << 20
    tmp = tempfile.TemporaryDirectory(prefix="weight-sync-sweep-")
    save_tokenizer(tmp.name)
    rows = []
    try:
        for world in [int(x) for x in args.sweep.split(",")]:
            ctl_port, sync_port, port = free_port(), free_port(), free_port()
            ctl = store(ctl_port, master=True)
            report = Path(tmp.name) / f"member-{world}.json"
            env = {"BENCH_SHAPES": json.dumps(spec), "BENCH_REPORT": str(report)}
            server = ["--role", "server", "--tokenizer", tmp.name, "--port", str(port)]
            procs: Procs = {"server": spawn(*server, env=env)}
            try:
                url = f"http://127.0.0.1:{port}"
                common = [
                    "--sweep-mib",
                    str(args.sweep_mib),
                    "--sweep-bucket-mib",
                    str(args.sweep_bucket_mib),
                ]
                common += [
                    "--senders",
                    str(world),
                    "--store-port",
                    str(ctl_port),
                    "--sync-port",
                    str(sync_port),
                ]
                rank = ["--role", "sweep-rank", *common]
                procs |= {
                    f"trainer rank {r} of {world}": spawn(*rank, "--index", str(r)) for r in range(world)
                }
                wait_health([url], procs)  # the ranks start meanwhile
                seconds = []
                for version in SWEEP_VERSIONS:
                    ctl.set(f"sweep-{version}", "go")
                    request = _stream_request(
                        [url], version, sync_port, spec, senders=world, epoch=SWEEP_EPOCH
                    )
                    seconds.append(asyncio.run(watched(request, procs)))
                    await_count(ctl, f"sweep-{version}-sent", world, procs)
                for r in range(world):
                    await_count(ctl, f"sweep-result-{r}", None, procs)
                peaks = [json.loads(ctl.get(f"sweep-result-{r}"))["peak"] for r in range(world)]
            finally:
                end(procs)
            member = json.loads(report.read_text())
            held = member[-1]["held"]
            rows.append(dict(
                transport="sweep", senders=world, model_bytes=held, bucket_bytes=bucket, seconds=seconds[-1],
                member_extra_bytes=max(v["extra_rss"] for v in member),
                member_reserve_planned=stream_receive_reserve(world, bucket),
                received_bytes=member[-1]["received"], received_over_held=member[-1]["received"] / held,
                rank_peak_bytes=max(peaks),
            ))  # fmt: skip
    finally:
        tmp.cleanup()
    print(
        f"\nsweep: one server, {args.sweep_mib} MiB in bf16, {args.sweep_bucket_mib} MiB buckets; "
        "a member's extra memory over a version (VmHWM; the first allocates what later ones reuse)"
    )
    print(f"{'senders':>7} {'s':>6} {'member extra MiB':>16} {'in buckets':>10} {'plan (no NCCL) MiB':>18} "
          f"{'received/held':>13} {'rank peak MiB':>13} {'in buckets':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['senders']:>7} {r['seconds']:>6.2f} {r['member_extra_bytes'] / 2**20:>16.1f} "
              f"{r['member_extra_bytes'] / bucket:>10.2f} "
              f"{(r['member_reserve_planned'] - NCCL_COMM_BYTES) / 2**20:>18.1f} "
              f"{r['received_over_held']:>13.4f} {r['rank_peak_bytes'] / 2**20:>13.1f} "
              f"{r['rank_peak_bytes'] / bucket:>10.2f}")  # fmt: skip
    extras = [r["member_extra_bytes"] for r in rows]
    print(f"member extra: {min(extras) / 2**20:.1f} to {max(extras) / 2**20:.1f} MiB over "
          f"{rows[0]['senders']} to {rows[-1]['senders']} senders (flat within one bucket: "
          f"{'yes' if max(extras) - min(extras) <= bucket else 'NO'})")  # fmt: skip
    return rows


# --- held bytes: expert-parallel members receive what they hold ------------------------------

HELD_EXPERTS, HELD_LAYERS, HELD_VERSIONS = 8, 4, (1, 2)


def held_shapes(args: argparse.Namespace) -> dict[str, list[int]]:
    """An MoE-shaped model of --sweep-mib in bf16: per layer a dense tensor (1/8 of the bytes) and a
    fused routed-expert tensor (dim 0 the expert)."""
    per_layer = (args.sweep_mib << 20) // 2 // HELD_LAYERS
    rows = max(8, per_layer // 8 // COLS)
    expert_rows = max(1, per_layer * 7 // 8 // COLS // HELD_EXPERTS)
    out = {}
    for i in range(HELD_LAYERS):
        out[f"layers.{i}.attn.weight"] = [rows, COLS]
        out[f"layers.{i}.mlp.experts.gate_up_proj"] = [HELD_EXPERTS, expert_rows, COLS]
    return out


def held_placements(servers: int) -> list[list[int]]:
    from grpo_wire.holdings import expert_placement

    return [expert_placement(k, servers, HELD_EXPERTS) for k in range(servers)]


def run_held_rank(rank: int, args: argparse.Namespace) -> None:
    from grpo_trainer.generation import member_classes
    from grpo_trainer.weight_sync import StreamSender, share
    from grpo_wire.holdings import Holding

    torch.set_num_threads(1)
    spec, world = held_shapes(args), args.senders
    g = torch.Generator().manual_seed(rank)
    items = []
    for k, shape in spec.items():
        lo, hi = share(math.prod(shape), rank, world)
        items.append((k, lo, torch.randn(hi - lo, generator=g)))
    placements = held_placements(args.held_servers)
    classes, holdings = member_classes([(1, [h]) for h in placements])
    experts = sorted(k for k in spec if ".experts." in k)
    ctl = store(args.store_port)
    sender = StreamSender("127.0.0.1", args.sync_port, rank, world=world, timeout_s=600)
    for version in HELD_VERSIONS:
        ctl.wait([f"held-{version}"])
        sender.send(iter(items), epoch=SWEEP_EPOCH, members=len(placements), backend="gloo",
                    dtype=torch.bfloat16, bucket_bytes=args.sweep_bucket_mib << 20,
                    device=torch.device("cpu"), classes=classes, held=[Holding(tuple(h)) for h in holdings],
                    shapes=spec, experts=experts)  # fmt: skip
        ctl.add(f"held-{version}-sent", 1)


def held(args: argparse.Namespace) -> list[dict]:
    """K servers, each one member holding EP rank k of K's experts (vLLM's linear placement), fed by
    the trainer ranks: what each receives against what it holds, and the whole model it took before."""
    spec, world = held_shapes(args), args.senders
    placements = held_placements(args.held_servers)
    whole = sum(2 * math.prod(shape) for shape in spec.values())
    tmp = tempfile.TemporaryDirectory(prefix="weight-sync-held-")
    save_tokenizer(tmp.name)
    ctl_port, sync_port = free_port(), free_port()
    ctl = store(ctl_port, master=True)
    ports = [free_port() for _ in placements]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: Procs = {}
    try:
        for k, (port, experts) in enumerate(zip(ports, placements, strict=True)):
            env = {"BENCH_SHAPES": json.dumps(spec), "BENCH_REPORT": str(Path(tmp.name) / f"server-{k}.json"),
                   "BENCH_HELD": json.dumps(experts)}  # fmt: skip
            server = ["--role", "server", "--tokenizer", tmp.name, "--port", str(port)]
            procs[f"server {k}"] = spawn(*server, env=env)
        common = ["--sweep-mib", str(args.sweep_mib), "--sweep-bucket-mib", str(args.sweep_bucket_mib)]
        common += ["--senders", str(world), "--store-port", str(ctl_port), "--sync-port", str(sync_port)]
        common += ["--held-servers", str(args.held_servers)]
        for r in range(world):
            procs[f"trainer rank {r} of {world}"] = spawn("--role", "held-rank", *common, "--index", str(r))
        wait_health(urls, procs)  # the ranks start meanwhile
        seconds = 0.0
        for version in HELD_VERSIONS:
            ctl.set(f"held-{version}", "go")
            request = _stream_request(urls, version, sync_port, spec, world, SWEEP_EPOCH, held=placements)
            seconds = asyncio.run(watched(request, procs))
            await_count(ctl, f"held-{version}-sent", world, procs)
        reports = [
            json.loads((Path(tmp.name) / f"server-{k}.json").read_text())[-1] for k in range(len(urls))
        ]
    finally:
        end(procs)
        tmp.cleanup()
    rows = [
        dict(transport="held", senders=world, member=k, experts=placements[k], model_bytes=whole,
             held_bytes=r["held"], received_bytes=r["received"], received_over_held=r["received"] / r["held"],
             whole_over_held=whole / r["held"], seconds=seconds, bucket_bytes=args.sweep_bucket_mib << 20)
        for k, r in enumerate(reports)
    ]  # fmt: skip
    print(
        f"\nheld bytes: {len(urls)} servers of one EP member each ({HELD_EXPERTS} experts, linear), "
        f"{world} trainer ranks, {whole / 2**20:.1f} MiB model in bf16"
    )
    print(f"{'member':>6} {'experts':>10} {'held MiB':>9} {'received MiB':>12} {'received/held':>13} "
          f"{'whole/held':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['member']:>6} {r['experts']!s:>10} {r['held_bytes'] / 2**20:>9.2f} "
              f"{r['received_bytes'] / 2**20:>12.2f} {r['received_over_held']:>13.4f} "
              f"{r['whole_over_held']:>10.2f}")  # fmt: skip
    return rows


# --- the controller --------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(*argv: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *argv], env={**os.environ, **(env or {})})


def save_tokenizer(directory: str) -> None:
    """The tiny model's tokenizer, for the servers; imported here, in the controller alone (transformers
    would add seconds to the start of every process of the benchmark)."""
    from grpo_trainer.tiny_model import build_tokenizer

    build_tokenizer().save_pretrained(directory)


def end(procs: Procs) -> None:
    """Kill the processes of a leg, the last started first: the trainer ranks go before the servers,
    so a failed run does not also print the errors of ranks whose servers were killed under them
    (a `WeightSyncError` of connections refused and reset, which looks like the cause)."""
    for proc in reversed(procs.values()):
        proc.kill()
        proc.wait()


def linger(store_port: int) -> None:
    """A trainer rank whose part is done stays until the controller ends it (kills it, or leaves and
    takes its store along): the controller counts every exit as a failure. A rank that returned raced
    the controller's last waits: the default run's rank 1 ended while rank 0 still pushed the http
    leg's last version, and the controller took that for a death and killed the servers under it."""
    ctl = store(store_port)
    try:
        while True:
            ctl.check(["-"])  # raises once the controller is gone
            time.sleep(1)
    except dist.DistError:
        return


async def _stream_request(
    urls: list[str],
    version: int,
    sync_port: int,
    spec: dict,
    senders: int = SENDERS,
    epoch: int = 7,
    held: list[list[int] | None] | None = None,
) -> float:
    from grpo_trainer.generation import member_classes
    from grpo_wire import weight_stream
    from grpo_wire.client import RolloutClient
    from grpo_wire.protocol import WeightStreamRequest

    members = len(urls)
    classes, holdings = member_classes([(1, None if held is None else [h]) for h in held or [None] * members])
    experts = sorted(k for k in spec if ".experts." in k) if classes else []
    reqs = {
        u: WeightStreamRequest(
            version=version, epoch=epoch, store_host="127.0.0.1", store_port=sync_port, backend="gloo",
            feeders=weight_stream.feeders_for(senders, members, "gloo", 1, len(holdings) or 1),
            members=members, first_member=i, timeout_s=600, tensors=spec, classes=classes,
            holdings=holdings, expert_tensors=experts,
        )
        for i, u in enumerate(urls)
    }  # fmt: skip
    t0 = time.perf_counter()
    async with RolloutClient(urls, TOKEN) as client:
        result = await client.stream_weights(reqs)
    if result.failed:
        raise BenchmarkFailed(f"version {version} did not go live on every server: {result.failed}")
    return time.perf_counter() - t0


class BenchmarkFailed(RuntimeError):
    """A process of the benchmark died or a leg failed: the run stops at once with the reason."""


Procs = dict[str, subprocess.Popen]  # role and index -> process


def check_alive(procs: Procs) -> None:
    """Raise, naming it, when any process of the benchmark has exited: every process lives until
    the controller kills it (a trainer rank whose part is done `linger`s), so an exit is a failure
    (its traceback is above, on stderr)."""
    for name, proc in procs.items():
        if (code := proc.poll()) is not None:
            raise BenchmarkFailed(f"{name} exited with status {code} (its error is printed above)")


def await_count(
    ctl: dist.TCPStore, key: str, count: int | None, procs: Procs, timeout_s: float = 900
) -> None:
    """Wait until the store's counter `key` reaches `count` (None: until the key exists), watching
    the processes meanwhile so a dead one fails the run instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while True:
        if count is None:
            if ctl.check([key]):
                return
        elif int(ctl.add(key, 0)) >= count:
            return
        check_alive(procs)
        if time.monotonic() > deadline:
            raise BenchmarkFailed(f"nothing reached {key!r} in {timeout_s:.0f} s")
        time.sleep(0.01)


async def watched(work, procs: Procs, timeout_s: float = 600):  # a coroutine, and its result
    """Await `work` while watching the processes: a dead one, or `timeout_s` passing while every
    process waits on another, cancels it and fails the run."""
    task = asyncio.ensure_future(work)
    deadline = time.monotonic() + timeout_s
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if not task.done():
            try:
                check_alive(procs)
                if time.monotonic() > deadline:
                    raise BenchmarkFailed(f"a weight version took over {timeout_s:.0f} s")
            except BenchmarkFailed:
                task.cancel()
                raise
    return task.result()


def wait_health(urls: list[str], procs: Procs, timeout_s: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    for u in urls:
        while True:
            try:
                urllib.request.urlopen(f"{u}/health", timeout=2)
                break
            except OSError:
                check_alive(procs)
                if time.monotonic() > deadline:
                    raise BenchmarkFailed(f"{u} did not answer /health in {timeout_s:.0f} s") from None
                time.sleep(0.2)


def transports(args: argparse.Namespace, spec: dict) -> list[dict]:
    """The table: both transports (the http row unless --only collective) against their links."""
    ctl_port, sync_port = free_port(), free_port()
    ctl = store(ctl_port, master=True)
    server_ports, raw_ports = [free_port() for _ in range(SERVERS)], [free_port() for _ in range(SERVERS)]
    urls = [f"http://127.0.0.1:{p}" for p in server_ports]
    raw_urls = [f"http://127.0.0.1:{p}" for p in raw_ports]
    common = ["--model-mib", str(args.model_mib), "--bucket-mib", str(args.bucket_mib)]
    common += ["--repeats", str(args.repeats)]
    common += ["--only", args.only] if args.only else []
    tmp = tempfile.TemporaryDirectory(prefix="weight-sync-bench-")
    save_tokenizer(tmp.name)  # servers render prompts with one, even here
    server = ["--role", "server", "--tokenizer", tmp.name, *common]
    env = {"BENCH_SHAPES": json.dumps(spec)}
    procs: Procs = {
        f"server {i}": spawn(*server, "--port", str(p), env=env) for i, p in enumerate(server_ports)
    }
    raw = ["--role", "raw", "--store-port", str(ctl_port), *common]
    procs |= {f"raw receiver {i}": spawn(*raw, "--index", str(i), "--port", str(p))
              for i, p in enumerate(raw_ports)}  # fmt: skip
    load_before = os.getloadavg()[0]
    try:
        rank_args = ["--store-port", str(ctl_port), "--sync-port", str(sync_port), "--servers", *urls]
        procs |= {f"trainer rank {r}": spawn("--role", "rank", "--index", str(r), *common, *rank_args,
                                             "--raw-urls", *raw_urls) for r in range(SENDERS)}  # fmt: skip
        wait_health(urls, procs)  # the ranks start meanwhile (their first link run is a warm-up)
        stream_s = []
        for version in stream_versions(args.repeats):
            await_count(ctl, f"link-{version}-done", SENDERS, procs)
            ctl.set(f"stream-{version}", "go")
            seconds = asyncio.run(watched(_stream_request(urls, version, sync_port, spec), procs))
            stream_s += [seconds] if version > 1 else []
            await_count(ctl, f"stream-{version}-sent", SENDERS, procs)
        for version in http_versions(args.repeats) if args.only is None else ():
            ctl.set(f"http-{version}", "go")
            await_count(ctl, f"http-{version}-done", SENDERS, procs)
        ctl.set("rawhttp", "go")
        for r in range(SENDERS):
            await_count(ctl, f"result-{r}", None, procs)
        res = [json.loads(ctl.get(f"result-{r}")) for r in range(SENDERS)]
    finally:
        end(procs)
        tmp.cleanup()
    mb = args.model_bytes_exact
    link_s = [max(runs) for runs in zip(*(r["raw_s"] for r in res), strict=True)]  # the slower rank's
    pairs = sorted(range(args.repeats), key=lambda i: link_s[i] / stream_s[i])
    mid = pairs[args.repeats // 2]  # the version whose share of its own link is the median one
    rows = [
        dict(transport="collective (gloo)", servers=SERVERS, model_bytes=mb, bucket_bytes=args.bucket_bytes,
             seconds=stream_s[mid], gb_per_s=mb / stream_s[mid] / 1e9, link_gb_per_s=mb / link_s[mid] / 1e9,
             of_link=link_s[mid] / stream_s[mid], best_of_best=min(link_s) / min(stream_s),
             peak_extra_bytes_per_rank=max(r["stream_peak_rss"] for r in res),
             tracked_buffer_bytes_per_rank=max(r["stream_tracked"] for r in res),
             all_seconds=stream_s, all_link_seconds=link_s,
             sender_seconds=[r["stream_s"][mid] for r in res],
             sender_waited_s=[r["waited_s"][mid] for r in res],
             sender_filled_s=[r["filled_s"][mid] for r in res]),
    ]  # fmt: skip
    rows += [
        dict(transport="http", servers=SERVERS, model_bytes=mb, bucket_bytes=args.bucket_bytes,
             seconds=res[0]["http_s"], gb_per_s=mb / res[0]["http_s"] / 1e9,
             link_gb_per_s=mb / res[0]["rawhttp_s"] / 1e9, of_link=res[0]["rawhttp_s"] / res[0]["http_s"],
             peak_extra_bytes_per_rank=max(r["http_peak_rss"] for r in res)),
    ] if args.only is None else []  # fmt: skip
    print(f"{'transport':18} {'servers':>7} {'model MiB':>9} {'bucket MiB':>10} {'s':>7} {'GB/s':>6} "
          f"{'link GB/s':>9} {'of link':>7} {'peak extra MiB/rank':>19} {'in buckets':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['transport']:18} {r['servers']:>7} {r['model_bytes'] / 2**20:>9.0f} "
              f"{r['bucket_bytes'] / 2**20:>10.0f} {r['seconds']:>7.2f} {r['gb_per_s']:>6.2f} "
              f"{r['link_gb_per_s']:>9.2f} {r['of_link']:>7.0%} "
              f"{r['peak_extra_bytes_per_rank'] / 2**20:>19.0f} "
              f"{r['peak_extra_bytes_per_rank'] / r['bucket_bytes']:>10.1f}")  # fmt: skip
    for r in rows:
        r["load_average_1min"] = [load_before, os.getloadavg()[0]]
    c = rows[0]
    per_rank = zip(c["sender_seconds"], c["sender_waited_s"], c["sender_filled_s"], strict=True)
    each = "; ".join(
        f"rank {r}: {sent:.2f} s, waited on the wire {w:.2f} s, converted into buckets {f:.2f} s"
        for r, (sent, w, f) in enumerate(per_rank)
    )
    runs = ", ".join(f"{x:.2f}" for x in c["all_seconds"])
    links = ", ".join(f"{x:.2f}" for x in c["all_link_seconds"])
    print(f"collective: {args.repeats} versions ({runs} s), each right after a link measurement ({links} s); "
          f"the row is the median version by its share of its own link; best version against best "
          f"link: {c['best_of_best']:.0%}")  # fmt: skip
    print(f"collective, that version: {each}")
    print(f"load average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          f"on {os.cpu_count()} cores")  # fmt: skip
    return rows


RANK_ROLES = {"rank": run_rank, "sweep-rank": run_sweep_rank, "held-rank": run_held_rank}  # by leg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-mib", type=int, default=1024, help="payload in the rollout dtype (bf16)")
    p.add_argument("--bucket-mib", type=int, default=WeightSync().bucket_mb, help="default: the API's")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument(
        "--only",
        choices=["collective", "sweep", "held"],
        default=None,
        help="collective: the collective row alone (no http, no sweep); sweep: the sweep alone; held: "
        "the held-bytes leg alone",
    )
    p.add_argument("--held-servers", type=int, default=4, help="the held leg's EP members (servers)")
    p.add_argument("--sweep", default="1,2,4,8", help="trainer ranks to sweep, to one server")
    p.add_argument("--sweep-mib", type=int, default=64, help="the sweep's model, in bf16")
    p.add_argument("--sweep-bucket-mib", type=int, default=8, help="the sweep's bucketMb")
    p.add_argument("--senders", type=int, default=SENDERS, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=REPEATS, help="measured collective versions")
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default="", help=argparse.SUPPRESS)
    p.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sync-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--servers", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--raw-urls", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model_bytes = args.model_mib << 20
    args.bucket_bytes = args.bucket_mib << 20
    spec = shapes(args.model_bytes)
    args.model_bytes_exact = sum(r * c * 2 for r, c in spec.values())
    if args.role == "server":
        run_server(args.port, args.tokenizer)
        return 0
    if args.role == "raw":
        run_raw(args.index, args.store_port, args.port, args.model_bytes_exact // SENDERS, 1 + args.repeats)
        return 0
    if args.role in RANK_ROLES:
        RANK_ROLES[args.role](args.index, args)
        linger(args.store_port)
        return 0

    rows: list[dict] = []
    try:
        if args.only in (None, "collective"):
            rows += transports(args, spec)
        if args.only in (None, "sweep"):
            rows += sweep(args)
        if args.only in (None, "held"):
            rows += held(args)
    except BenchmarkFailed as e:
        print(f"weight_sync benchmark failed: {e}", file=sys.stderr)
        return FAILED_EXIT
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
