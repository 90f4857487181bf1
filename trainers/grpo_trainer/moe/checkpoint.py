"""Checkpoints of expert-parallel models: load only the local experts, gather the full state back.

Called by the trainer: `load_checkpoint` after `expert_parallel` to fill a sharded model from a
Hugging Face safetensors checkpoint (per-expert tensors as `save_pretrained` writes them, or
fused 3-D `experts.gate_up_proj`/`experts.down_proj` tensors, of which only this rank's slice
is read); `iter_full_state_dict`/`full_state_dict` to rebuild the unsharded state dict (HF
in-memory names and shapes) for saving and for weight sync to the rollout engines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from grpo_trainer.moe.layer import MoELayer

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_FUSED = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<name>gate_up_proj|down_proj)$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _model_key(key: str) -> str:
    """Checkpoint name → in-memory name (Mixtral checkpoints call the MoE block block_sparse_moe)."""
    return key.replace(".block_sparse_moe.", ".mlp.")


def _files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return files


def _load_expert_key(f, key: str, layers: dict[str, MoELayer], target: dict, filled: set[str]) -> bool:
    """Copy this rank's part of an expert tensor; False when `key` is no expert tensor of ours."""
    name = _model_key(key)
    match = _PER_EXPERT.match(name) or _FUSED.match(name)
    layer = layers.get(match["prefix"]) if match else None
    if layer is None:
        return False
    prefix = match["prefix"] + ".experts."
    lo, n = layer.experts.held()
    if "name" in match.groupdict():  # fused (E, ...) tensor: read our slice only
        if n:
            _local(target[prefix + match["name"]]).copy_(f.get_slice(key)[lo : lo + n])
        filled.update(f"{prefix}{match['name']}.{i}" for i in range(n))
        return True
    local = int(match["e"]) - lo
    if not 0 <= local < n:
        return True  # another rank's expert: never read
    proj = _MIXTRAL_PROJ.get(match["proj"], match["proj"])
    inter = layer.experts.down_proj.shape[-1]
    if proj == "down_proj":
        _local(target[prefix + "down_proj"])[local].copy_(f.get_tensor(key))
        filled.add(f"{prefix}down_proj.{local}")
    else:
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        _local(target[prefix + "gate_up_proj"])[local, rows].copy_(f.get_tensor(key))
        filled.add(f"{prefix}gate_up_proj.{local}.{proj}")
    return True


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores (an FSDP2 DTensor's local chunk)."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Fill `model` (after `expert_parallel`) from safetensors; reads only this rank's experts.

    Raises KeyError naming the tensors the checkpoint did not provide.
    """
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    target = model.state_dict()
    filled: set[str] = set()
    for file in _files(path):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if _load_expert_key(f, key, layers, target, filled):
                    continue
                name = _model_key(key)
                if name in target:
                    target[name].copy_(f.get_tensor(key))
                    filled.add(name)
    expected = set()
    for name, layer in layers.items():
        prefix, n = f"{name}.experts.", layer.experts.held()[1]
        expected.update(f"{prefix}down_proj.{i}" for i in range(n))
        expected.update(f"{prefix}gate_up_proj.{i}.{p}" for i in range(n) for p in ("gate_proj", "up_proj"))
        if all(f"{prefix}gate_up_proj.{i}" in filled for i in range(n)):  # fused checkpoint
            expected -= {f"{prefix}gate_up_proj.{i}.{p}" for i in range(n) for p in ("gate_proj", "up_proj")}
        filled |= {prefix + "gate_up_proj", prefix + "down_proj"}
    tied = {target[k].data_ptr() for k in filled if k in target}
    missing = sorted(expected - filled)
    missing += [k for k, t in target.items() if k not in filled and t.data_ptr() not in tied]
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors of {type(model).__name__}: {missing[:8]}")


def iter_full_state_dict(
    model: nn.Module, *, gather_experts: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the unsharded model, one at a time (bounded memory for weight sync).

    Collective over each MoE layer's EP group, and for FSDP2 DTensors (`full_tensor()`) over
    their mesh (the world for dense tensors, the expert data-parallel group for experts split
    further by FSDP): every rank must iterate it to the end. gather_experts=False: a rank outside
    the group whose result is used takes part in the DTensor gathers only (its expert items are
    its EP block, to be dropped).
    """
    sharded = {}
    for name, layer in model.named_modules():
        if isinstance(layer, MoELayer) and layer.experts.group is not None:
            sharded[f"{name}.experts.gate_up_proj"] = layer.experts.group
            sharded[f"{name}.experts.down_proj"] = layer.experts.group
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()  # dense: the whole tensor; experts: this rank's EP block
        group = sharded.get(name)
        if group is None or dist.get_world_size(group) == 1 or not gather_experts:
            yield name, tensor
            continue
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        yield name, torch.cat(parts)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, identical in names and shapes to the model before `expert_parallel`."""
    return dict(iter_full_state_dict(model))
