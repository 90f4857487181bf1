"""The checkpoint's key space: one global name per tensor, whatever the gang's shape.

Called by `grpo_trainer.checkpoint.saver` (what this rank writes) and `.resume` (what this rank
reads). Keys do not depend on the world size, the EP size or the ZeRO partition, which is what
makes a save load at any shape:

    model.layers.0.self_attn.q_proj.weight          dense tensor (HF name)
    model.layers.0.mlp.experts.gate_up_proj.5       expert 5's slice of a fused expert tensor
    optim.<one of the above>.exp_avg|exp_avg_sq|step  AdamW state of that tensor (ZeRO or not)
    rng.torch.<rank>                                 this rank's RNG (restored at the same rank only)

A rank holding expert e under EP writes `...gate_up_proj.e` from its local shard; at EP = 1 the
same key is a slice of the unsharded tensor; under `sharding: full` with world > EP, where FSDP
splits each EP block in whole experts over expert-DP, the one rank storing expert e writes it.
Replicated tensors are written once: each key is assigned to one of its replicas by `assign`
(largest first, to the least-loaded replica), the same on every replica without any
communication. DTensor values (FSDP2) are written by every rank: DCP records each rank's local
chunk of the global tensor, so they need no assignment.
"""

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from grpo_trainer.config import RankInfo
from grpo_trainer.moe.layer import MoELayer
from grpo_trainer.optim import GangAdamW

FUSED = re.compile(r"^(?P<prefix>.+)\.experts\.(?:gate_up_proj|down_proj)$")
OPTIM, RNG = "optim.", "rng.torch."
# Who else holds the same tensor: every rank, the ranks with the same EP rank, or no one.
Holders = Literal["world", "expert_dp", "own"]


@dataclass(frozen=True)
class Entry:
    tensor: torch.Tensor
    holders: Holders


def _experts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Fused expert tensor name → (global id of the first expert this rank stores, how many)."""
    out = {}
    for name, layer in model.named_modules():
        if isinstance(layer, MoELayer):
            out[f"{name}.experts.gate_up_proj"] = out[f"{name}.experts.down_proj"] = layer.experts.held()
    return out


def _split(name: str, t: torch.Tensor, experts: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor] | None:
    """Per-expert views of a fused (E, ...) expert tensor (of an FSDP2 DTensor's local whole
    experts); None for any other tensor."""
    if not FUSED.match(name) or t.dim() != 3:
        return None
    local = t.to_local() if isinstance(t, DTensor) else t
    first, n = experts.get(name, (0, t.shape[0]))  # an HF block at EP = 1 holds every expert
    return {f"{name}.{first + i}": local[i] for i in range(n)}


def _expert_holders(t: torch.Tensor) -> Holders:
    """Experts split by FSDP over expert-DP have one holder; plain ones are replicated over it."""
    return "own" if isinstance(t, DTensor) else "expert_dp"


def model_entries(model: nn.Module) -> dict[str, Entry]:
    experts, out, seen = _experts(model), {}, set()
    for name, t in model.state_dict().items():
        parts = _split(name, t, experts)
        if parts is not None:
            out.update({k: Entry(v, _expert_holders(t)) for k, v in parts.items()})
            continue
        if isinstance(t, DTensor):
            out[name] = Entry(t, "own")
            continue
        if (t.data_ptr(), t.shape) in seen:  # tied weights: one key
            continue
        seen.add((t.data_ptr(), t.shape))
        out[name] = Entry(t, "world")
    return out


def _adamw_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fresh AdamW state for `p`, as torch.optim.AdamW creates it (step a float32 CPU scalar)."""
    return {
        "step": torch.tensor(0.0, dtype=torch.float32),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def optimizer_entries(model: nn.Module, optimizer: GangAdamW, *, create: bool = False) -> dict[str, Entry]:
    """AdamW state of the parameters this rank updates, under the model's keys.

    ZeRO-1 state is this rank's own partition ("own"); without ZeRO the state is replicated like
    its parameters. `create`: give every parameter fresh state to load into (resume)."""
    names = {id(p): n for n, p in model.named_parameters()}
    experts = _experts(model)
    out: dict[str, Entry] = {}
    for family, opt in optimizer._each():
        local = GangAdamW._local(opt)
        holders: Holders = (
            "own"
            if isinstance(opt, ZeroRedundancyOptimizer)
            else ("world" if family == "dense" else "expert_dp")
        )
        for group in local.param_groups:
            for p in group["params"]:
                if create:  # an offloading optimizer makes its state in host memory
                    local.state[p] = getattr(local, "fresh_state", _adamw_state)(p.detach())
                state = local.state.get(p)
                if not state:
                    continue  # no step taken yet: AdamW creates it lazily
                name = names[id(p)]
                mine = _expert_holders(p) if family == "experts" and holders != "own" else holders
                for key, value in state.items():
                    if not isinstance(value, torch.Tensor):
                        continue
                    if value.dim() == 0:  # step: one copy per expert key, so any shape finds it
                        for k in _split(name, p.detach(), experts) or [name]:
                            out[f"{OPTIM}{k}.{key}"] = Entry(value, mine)
                        continue
                    parts = _split(name, value, experts)
                    if parts is None and isinstance(value, DTensor):  # FSDP2: each rank its own chunk
                        out[f"{OPTIM}{name}.{key}"] = Entry(value, "own")
                        continue
                    for k, v in (parts or {name: value}).items():
                        out[f"{OPTIM}{k}.{key}"] = Entry(v, mine)
    return out


def rng_entries(info: RankInfo) -> dict[str, Entry]:
    return {f"{RNG}{info.rank}": Entry(torch.get_rng_state(), "own")}


def assign(sizes: dict[str, int], replicas: int) -> dict[str, int]:
    """key → the replica (0..replicas-1) that writes it: largest first, to the least-loaded replica.

    Pure and deterministic, so every replica computes the same answer on its own."""
    load, out = [0] * replicas, {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(replicas), key=lambda i: (load[i], i))
        out[key] = r
        load[r] += sizes[key]
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def rank_state(entries: dict[str, Entry], info: RankInfo) -> dict[str, torch.Tensor]:
    """The tensors this rank writes: its own, and the replicated ones `assign` gives it."""
    dp = info.world_size // info.ep_size
    mine = {k: e.tensor for k, e in entries.items() if e.holders == "own"}
    for holders, replicas, me in (
        ("world", info.world_size, info.rank),
        ("expert_dp", dp, info.rank // info.ep_size),
    ):
        sizes = {k: _nbytes(e.tensor) for k, e in entries.items() if e.holders == holders}
        mine.update({k: entries[k].tensor for k, r in assign(sizes, replicas).items() if r == me})
    return mine


def drop_unloaded(model: nn.Module, optimizer: GangAdamW, loaded: set[str]) -> None:
    """After a load with `optimizer_entries(create=True)`: parameters whose state the save did not
    hold (no step taken before it) get no state, as AdamW would have it."""
    names, experts = {id(p): n for n, p in model.named_parameters()}, _experts(model)
    for _, opt in optimizer._each():
        local = GangAdamW._local(opt)
        for group in local.param_groups:
            for p in group["params"]:
                keys = _split(names[id(p)], p.detach(), experts) or {names[id(p)]: p}
                if not any(f"{OPTIM}{k}.exp_avg" in loaded for k in keys):
                    local.state.pop(p, None)
