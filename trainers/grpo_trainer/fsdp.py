"""`trainer.sharding: full`: FSDP2 over the data-parallel dimension, composed with expert parallelism.

Called by `grpo_trainer.parallel.load_policy` on the meta-device model, after
`moe.expert_parallel` and before the weights are materialised (torchtitan's `apply_fsdp`):
- every decoder layer, then the root, is `fully_shard`ed over a 1-D mesh of the whole world:
  dense parameters (attention, norms, routers, shared experts, embeddings, head), their
  gradients and their AdamW state are split in rows over the world;
- routed experts, already split by EP, are split again when world > EP: each MoE layer's
  `GroupedExperts` is `fully_shard`ed on its own, first, over the expert data-parallel group
  (the ranks with the same EP rank: torchtitan's dp_mod_ep / efsdp mesh), in whole experts
  (Shard(0); a rank keeps ceil(E_local / expert-DP) of them, fewer at the end). Their weights,
  gradients (reduce-scattered over that group) and AdamW state then divide by world / EP. At
  world = EP there is no such group: experts are left out (`ignored_params`) as plain tensors;
- gradients are summed, not averaged (divide factor 1), like `sync_gradients`: the loss is
  already normalised by the step's global totals;
- on GPU `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` over fp32 master weights;
  on CPU (gloo) fp32 throughout, so the tests run here;
- activation checkpointing (`checkpoint_layer`) per decoder layer, inside FSDP's hooks, so a
  layer's parameters are gathered once for its forward and once for recompute + backward.
"""

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF causal LM (`model.model.layers` for every supported architecture)."""
    return list(model.get_decoder().layers)


def checkpoint_layer(layer: nn.Module) -> None:
    """Recompute `layer`'s forward in backward instead of keeping its activations. Its module
    hooks (FSDP2's unshard/reshard) stay outside the recomputed region and its names unchanged."""
    forward = layer.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = run


def world_mesh(device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def expert_mesh(group: dist.ProcessGroup | None, device: torch.device) -> DeviceMesh | None:
    """The expert data-parallel group as a 1-D mesh (no new process group); None at world = EP."""
    if group is None:
        return None
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("efsdp",))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    experts: list[nn.Module],
    experts_mesh: DeviceMesh | None,
    bf16: bool,
) -> None:
    """fully_shard each of `experts` over `experts_mesh` (or leave their parameters alone when it
    is None), then every decoder layer, then the root, over `mesh`."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    ignored: set[nn.Parameter] = set()
    for module in experts:
        if experts_mesh is None:
            ignored.update(module.parameters())
        else:  # FSDP2's default Shard(0): whole experts per rank, as the loader and checkpoints expect
            fully_shard(module, mesh=experts_mesh, mp_policy=policy)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the loss carries the global normalisation
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
