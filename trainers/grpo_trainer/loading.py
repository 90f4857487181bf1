"""Sharded loading of the policy and reference models: each rank reads only what it keeps.

Called by `grpo_trainer.parallel.load_policy`. Steps (torchtitan's order: build, parallelise,
materialise, fill):
1. `skeleton`: the HF model from its config.json on the meta device (no memory, nothing read);
2. the caller applies `moe.expert_parallel` (experts sliced to this rank's block, still meta)
   and, under `trainer.sharding: full`, FSDP2 (`grpo_trainer.fsdp`: dense parameters become
   DTensors whose local chunk is this rank's rows);
3. `materialize`: allocate only the local tensors on the device, in the training dtype (fp32
   master weights), and recompute the non-persistent buffers (rotary frequencies);
4. `fill`: for every tensor of the safetensors files, read only this rank's part straight into
   its parameter: its experts (`moe.checkpoint._load_expert_key`: slices of fused tensors, or
   only its per-expert tensors; under `full` with world > EP only the whole experts FSDP leaves
   it of its EP block), its row chunk of each FSDP-sharded dense tensor
   (`safe_open(...).get_slice(key)[lo:hi]`), or the whole tensor when it is replicated here.
   Returns the bytes read, which tests count independently by wrapping `safe_open`.
The whole model never exists on one host, in any dtype.
"""

import logging

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM

from grpo_trainer.moe import checkpoint as moe_checkpoint
from grpo_trainer.moe.layer import MoELayer

log = logging.getLogger(__name__)


def skeleton(local_dir: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The HF model of `local_dir`'s config.json on the meta device (nothing allocated or read)."""
    config = AutoConfig.from_pretrained(local_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config._name_or_path = local_dir  # what from_pretrained would record (export reads it)
    return model


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the (local) tensors on `device`, uninitialised, and recompute non-persistent buffers."""
    model.to_empty(device=device)
    for module in model.modules():
        if not getattr(module, "_non_persistent_buffers_set", None):
            continue
        fresh = _rebuilt(module, model.config)
        for name in module._non_persistent_buffers_set:
            module._buffers[name] = getattr(fresh, name).to(device)


def _rebuilt(module: nn.Module, config) -> nn.Module:
    """A fresh CPU instance of a module with computed buffers (HF rotary embeddings take the config)."""
    try:
        with torch.device("cpu"):
            return type(module)(getattr(module, "config", config))
    except TypeError as e:
        raise NotImplementedError(
            f"{type(module).__name__} has non-persistent buffers that meta-device loading cannot rebuild"
        ) from e


def _local_rows(t: torch.Tensor) -> tuple[torch.Tensor, slice | None]:
    """(the local tensor to fill, its rows of the global tensor; None: the whole tensor)."""
    if not isinstance(t, DTensor):
        return t, None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(t.shape[1:]):
        raise NotImplementedError(
            f"only row (Shard(0)) sharding is filled from safetensors, got {t.placements}"
        )
    return t.to_local(), slice(offset[0], offset[0] + shape[0])


class _Counting:
    """A safe_open handle that counts the bytes of the tensors it returns."""

    def __init__(self, handle) -> None:
        self.handle, self.bytes = handle, 0

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        t = self.handle.get_tensor(key)
        self.bytes += t.numel() * t.element_size()
        return t

    def get_slice(self, key: str):
        outer, sl = self, self.handle.get_slice(key)

        class _Slice:
            def __getitem__(self, index):
                t = sl[index]
                outer.bytes += t.numel() * t.element_size()
                return t

        return _Slice()


@torch.no_grad()
def fill(model: nn.Module, path: str) -> int:
    """Copy this rank's part of every tensor from the safetensors under `path`; the bytes read.

    Raises KeyError naming tensors the checkpoint did not provide."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    target = model.state_dict()
    filled: set[str] = set()
    total = 0
    for file in moe_checkpoint._files(path):
        with safe_open(str(file), "pt") as raw:
            f = _Counting(raw)
            for key in raw.keys():  # noqa: SIM118 - safe_open is not a mapping
                if moe_checkpoint._load_expert_key(f, key, layers, target, filled):
                    continue
                name = moe_checkpoint._model_key(key)
                if name not in target:
                    continue
                local, rows = _local_rows(target[name])
                if rows is None:
                    local.copy_(f.get_tensor(key))
                elif rows.stop > rows.start:  # a rank past the end of a short tensor holds no rows
                    local.copy_(f.get_slice(key)[rows])
                filled.add(name)
            total += f.bytes
    _check_filled(model, layers, target, filled)
    return total


def _storage(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).data_ptr()


def _check_filled(model: nn.Module, layers: dict, target: dict, filled: set[str]) -> None:
    expected = set()
    for name, layer in layers.items():
        prefix, n = f"{name}.experts.", layer.experts.held()[1]
        per_expert = {f"{prefix}gate_up_proj.{i}.{p}" for i in range(n) for p in ("gate_proj", "up_proj")}
        expected |= {f"{prefix}down_proj.{i}" for i in range(n)}
        if not all(f"{prefix}gate_up_proj.{i}" in filled for i in range(n)):  # not a fused checkpoint
            expected |= per_expert
        filled |= {prefix + "gate_up_proj", prefix + "down_proj"}
    tied = {_storage(target[k]) for k in filled if k in target}
    missing = sorted(expected - filled)
    missing += [k for k, t in target.items() if k not in filled and _storage(t) not in tied]
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors of {type(model).__name__}: {missing[:8]}")
