"""Hugging Face exports of the policy, written by every rank at once, the model never gathered.

Called by the training loop (`grpo_trainer.loop.export`) on every rank, every
`checkpoint.exportEverySteps` steps into `<checkpointDir>/export/step-N` and at the end into
`<checkpointDir>/final`, on the same store as the checkpoints (s3://, a shared pvc:// or a local
path); also by the GPU benchmark (`export_hf(model, dest, ...)`). The result is what
`save_pretrained` writes for the unsharded model in `dtype`: the same checkpoint names (routed
experts one tensor each, tied weights once), config.json, generation_config.json and the
tokenizer, as safetensors shards with `model.safetensors.index.json`.

How (`export_plan` decides who writes what): a routed expert is written by a rank that stores
it (checkpoint names are per expert, so experts split by EP need no gather); a replicated dense
tensor by any rank; an FSDP2-sharded dense tensor is gathered, alone and already cast to
`dtype`, to the one rank that writes it. Each rank streams its files
(`safetensors_stream`: header first, then each tensor as it comes). The bound: beyond its
training state, a rank holds at most one checkpoint tensor in `dtype` (the largest the model
has: the embedding or the head, 0.6 GB in bf16 for Qwen3-30B-A3B) plus, while gathering it,
its own chunk of it; never the model (122 GB in fp32). One tensor, not one output file, because
the writer needs no more: a file is written as it goes, whatever its size.

Complete means `config.json` is there: it is uploaded last, after every rank's files and the
index, so an interrupted export never looks complete, and a complete one at `dest` is not
written again (a restart after the final export skips it). An incomplete one is removed first.
"""

import contextlib
import copy
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from grpo_operator import storage
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from grpo_trainer.checkpoint import export_plan
from grpo_trainer.checkpoint.safetensors_stream import StreamWriter, TensorSpec
from grpo_trainer.moe.layer import MoELayer

log = logging.getLogger(__name__)
CONFIG = "config.json"
DEFAULT_SHARD_BYTES = 4 << 30  # per file; a file is streamed, so this bounds no memory
EXPERT = ".experts.0."  # how a one-expert slice's outputs are named before renumbering


@dataclass(frozen=True)
class Exported:
    """What this rank did in one export."""

    skipped: bool  # `dest` already held a complete export
    files: int
    nbytes: int
    seconds: float


def export_hf(
    model: nn.Module,
    dest: str,
    *,
    dtype: torch.dtype,
    tokenizer_from: str,
    device: torch.device,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Exported:
    """Collective on every rank of the default group: write `model` (EP- and FSDP2-sharded as it
    trains) as a Hugging Face model directory at `dest` in `dtype`, the tokenizer read from the
    local directory `tokenizer_from`. `device`: where the gang's collectives run (its backend's
    device). Raises RuntimeError on every rank when any rank failed to write its part."""
    t0 = time.monotonic()
    rank, world = dist.get_rank(), dist.get_world_size()
    fs, path = storage.filesystem(dest)
    if _agree(rank == 0 and _complete(fs, path), device):
        return Exported(skipped=True, files=0, nbytes=0, seconds=time.monotonic() - t0)
    error: BaseException | None = None
    if rank == 0:
        try:
            _clear(fs, path)
        except OSError as e:  # told to every rank: none is left waiting in a collective
            error = e
    if not _agree(rank != 0 or error is None, device):  # also: nobody writes before the clear
        raise RuntimeError(
            f"Hugging Face export to {dest}: rank 0 could not clear it (its log says why)"
        ) from error
    units = export_units(model, _holders(model, device), world)
    plan = export_plan.plan(units, world, dtype.itemsize, max_shard_bytes)
    error, nbytes = _write_files(model, units, plan, fs, path, dtype, rank)
    failed = _failed_ranks(error is None, device)
    if failed:
        raise RuntimeError(
            f"Hugging Face export to {dest}: ranks {failed} failed to write their files (their logs say why)"
        ) from error
    if rank == 0:
        try:
            _write_rest(model, plan, fs, path, dtype, tokenizer_from)
        except Exception as e:  # told to every rank below, never left waiting
            error = e
    if not _agree(rank != 0 or error is None, device):
        raise RuntimeError(
            f"Hugging Face export to {dest}: rank 0 failed to write config and index"
        ) from error
    seconds = time.monotonic() - t0
    mine = len(plan.of(rank))
    log.info("export %s: rank %d wrote %d file(s), %.1f MB in %.2fs", dest, rank, mine, nbytes / 1e6, seconds)
    return Exported(skipped=False, files=mine, nbytes=nbytes, seconds=seconds)


def export_units(
    model: nn.Module, holders: dict[str, list[tuple[int, int]]], world: int
) -> list[export_plan.Unit]:
    """The export's units in state-dict order, named and shaped from meta tensors (no data).
    `holders`: per MoE layer, each rank's (first expert, count) stored, over `world` ranks."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    kept = set(remove_tied_weights_from_state_dict(dict(state), model)) - set(
        model._keys_to_ignore_on_save or ()
    )
    fused = _fused_experts(model)
    units = []
    for key, tensor in state.items():
        if key not in kept or not isinstance(tensor, torch.Tensor):
            continue
        if key in fused:
            layer_name, layer = fused[key]
            one = _revert(model, key, torch.empty((1, *tensor.shape[1:]), device="meta"))
            for e in range(layer.experts.num_experts):
                outputs = tuple((_renumber(n, e), tuple(t.shape)) for n, t in one.items())
                have = tuple(r for r, (lo, n) in enumerate(holders[layer_name]) if lo <= e < lo + n)
                units.append(export_plan.Unit(key, e, outputs, have or (-1,)))
            continue
        outputs = tuple(
            (n, tuple(t.shape))
            for n, t in _revert(model, key, torch.empty(tensor.shape, device="meta")).items()
        )
        units.append(
            export_plan.Unit(key, None, outputs, () if isinstance(tensor, DTensor) else tuple(range(world)))
        )
    return units


def _fused_experts(model: nn.Module) -> dict[str, tuple[str, MoELayer]]:
    """State-dict key of each fused expert parameter -> (its MoE layer's name, the layer)."""
    return {
        f"{name}.experts.{p}": (name, layer)
        for name, layer in model.named_modules()
        if isinstance(layer, MoELayer)
        for p, _ in layer.experts.named_parameters(recurse=False)
    }


def _revert(model: nn.Module, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' own in-memory -> checkpoint conversion (the one save_pretrained applies),
    for one entry: renames, and splits of fused tensors into views."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {key: tensor})


def _renumber(name: str, expert: int) -> str:
    if name.count(EXPERT) != 1:
        raise ValueError(f"cannot number checkpoint tensor {name}: expected one '{EXPERT}' in it")
    return name.replace(EXPERT, f".experts.{expert}.")


def _holders(model: nn.Module, device: torch.device) -> dict[str, list[tuple[int, int]]]:
    """Collective: per MoE layer, every rank's stored experts as (first, count)."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
    if not layers:
        return {}
    mine = torch.tensor([m.experts.held() for _, m in layers], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    table = torch.stack(every).cpu().tolist()  # (rank, layer, 2)
    return {name: [tuple(table[r][i]) for r in range(len(table))] for i, (name, _) in enumerate(layers)}


def _write_files(
    model: nn.Module,
    units: Sequence[export_plan.Unit],
    plan: export_plan.Plan,
    fs: Any,
    path: str,
    dtype: torch.dtype,
    rank: int,
) -> tuple[BaseException | None, int]:
    """Collective (the gathers): every rank walks every unit in order; the writer of each
    streams its tensors into its next file. A failing rank stops writing but keeps taking part
    in the gathers, so no rank is left waiting. Returns (this rank's error, bytes written)."""
    state = model.state_dict()
    first = {key: layer.experts.held()[0] for key, (_, layer) in _fused_experts(model).items()}
    files = iter(plan.of(rank))
    if plan.of(rank):  # every writer: a pod-local path has no folder rank 0 made
        fs.makedirs(path, exist_ok=True)
    out, writer, error, nbytes = None, None, None, 0
    for unit in units:
        owner = plan.writer[unit]
        tensor = _gather_to(state[unit.source], owner, dtype) if not unit.holders else None
        if owner != rank or error is not None:
            continue
        try:
            if writer is None:
                f = next(files)
                out = fs.open(f"{path}/{f.name}", "wb")
                specs = [TensorSpec(n, shape, dtype) for u in f.units for n, shape in u.outputs]
                writer = StreamWriter(out, specs, {"format": "pt"})
            source = state[unit.source] if tensor is None else tensor
            for name, t in _outputs(model, unit, _local(source), first.get(unit.source, 0), dtype):
                writer.write(name, t)
                nbytes += t.numel() * t.element_size()
            if writer.done():
                _close(out)
                out, writer = None, None
        except Exception as e:
            error = e
            log.error("export: rank %d failed writing %s: %s", rank, unit.source, e)
    if out is not None:
        out.close()
        error = error or RuntimeError(f"rank {rank} ended the export with its file unfinished")
    return error, nbytes


def _outputs(
    model: nn.Module, unit: export_plan.Unit, tensor: torch.Tensor, first: int, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """The unit's checkpoint tensors in `dtype`, one cast at a time (views until then)."""
    if unit.expert is None:
        views = _revert(model, unit.source, tensor)
    else:
        i = unit.expert - first
        views = {
            _renumber(n, unit.expert): t for n, t in _revert(model, unit.source, tensor[i : i + 1]).items()
        }
    for name, _ in unit.outputs:
        yield name, views[name].to(dtype)


def _gather_to(t: torch.Tensor, dst: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Collective over `t`'s mesh: the whole of an FSDP2 row-sharded DTensor on rank `dst` (None
    elsewhere), each chunk cast to `dtype` before it is sent; one tensor's room on `dst`."""
    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        placements = getattr(t, "placements", "not a DTensor")
        raise NotImplementedError(f"export gathers row-sharded DTensors on a 1-D mesh only, got {placements}")
    group = t.device_mesh.get_group()
    n, me = dist.get_world_size(group), dist.get_rank(group)
    rows = t.shape[0]
    chunk = math.ceil(rows / n)
    local = t.to_local().to(dtype)
    if local.shape[0] != max(0, min(chunk, rows - me * chunk)):
        raise ValueError(
            f"a DTensor chunk of {local.shape[0]} rows is not torch.chunk's for rank {me} of {n}"
        )
    if local.shape[0] < chunk:  # the last ranks' chunks are short: pad to the common size
        local = torch.cat([local, local.new_zeros((chunk - local.shape[0], *local.shape[1:]))])
    if dist.get_rank() != dst:
        dist.gather(local.contiguous(), None, dst=dst, group=group)
        return None
    full = torch.empty((n * chunk, *t.shape[1:]), dtype=dtype, device=local.device)
    dist.gather(local.contiguous(), list(full.split(chunk)), dst=dst, group=group)
    return full[:rows]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _close(f: Any) -> None:
    """Close a file, durable first (local files fsynced; object stores are durable on close)."""
    f.flush()
    with contextlib.suppress(AttributeError, OSError, ValueError):  # no fileno: not a local file
        os.fsync(f.fileno())
    f.close()


def _write_rest(
    model: nn.Module, plan: export_plan.Plan, fs: Any, path: str, dtype: torch.dtype, tokenizer_from: str
) -> None:
    """Rank 0, once every rank's files are durable: tokenizer, generation config, the index, and
    config.json last (the sign that the export is complete)."""
    from transformers import AutoTokenizer

    config = copy.deepcopy(model.config)
    config.dtype = str(dtype).removeprefix("torch.")  # what save_pretrained records: the weights' dtype
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # FSDP2 renames the class
    numel = sum(u.numel() for f in plan.files for u in f.units)
    index = {
        "metadata": {"total_parameters": numel, "total_size": numel * dtype.itemsize},
        "weight_map": dict(sorted(plan.weight_map().items())),
    }
    with tempfile.TemporaryDirectory(prefix=".export-") as tmp:
        staging = Path(tmp)
        AutoTokenizer.from_pretrained(tokenizer_from, local_files_only=True).save_pretrained(staging)
        if model.can_generate():
            model.generation_config.save_pretrained(staging)
        (staging / export_plan.INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config.save_pretrained(staging)
        last = (export_plan.INDEX, CONFIG)
        files = [p for p in sorted(staging.rglob("*")) if p.is_file() and p.name not in last]
        for f in [*files, staging / export_plan.INDEX, staging / CONFIG]:
            fs.put_file(str(f), f"{path}/{f.relative_to(staging).as_posix()}")


def _complete(fs: Any, path: str) -> bool:
    fs.invalidate_cache(path)
    return fs.exists(f"{path}/{CONFIG}") and fs.exists(f"{path}/{export_plan.INDEX}")


def _clear(fs: Any, path: str) -> None:
    """Remove an earlier, incomplete or other, export at `path`, config.json first: a half-removed
    export never looks complete. Then make the folder (object stores need none)."""
    fs.invalidate_cache(path)
    if fs.exists(f"{path}/{CONFIG}"):
        fs.rm_file(f"{path}/{CONFIG}")
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.makedirs(path, exist_ok=True)


def _agree(flag: bool, device: torch.device) -> bool:
    """Collective: rank 0's `flag` on every rank."""
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    return bool(t.item())


def _failed_ranks(ok: bool, device: torch.device) -> list[int]:
    mine = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [r for r, t in enumerate(every) if not t.item()]
