"""`trainer.sharding: full`: FSDP2 over the data-parallel dimension, composed with expert parallelism.

Called by `grpo_trainer.parallel.load_policy` on the meta-device model, after
`moe.expert_parallel` and before the weights are materialised (torchtitan's `apply_fsdp`):
- every decoder layer, then the root, is `fully_shard`ed over a 1-D mesh of the whole world:
  dense parameters (attention, norms, routers, shared experts, embeddings, head), their
  gradients and their AdamW state are split in rows over the world;
- routed experts already split by EP are left out (`ignored_params`): they stay plain tensors,
  replicated over their expert-DP group (the ranks with the same EP rank), whose gradients
  `grpo_trainer.parallel.sync_gradients` sums and whose AdamW state ZeRO-1 splits. (Sharding
  them again by FSDP over the expert-DP group, torchtitan's dp_shard_mod_ep mesh, is not done.)
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


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, ignored: set[nn.Parameter], bf16: bool) -> None:
    """fully_shard every decoder layer, then the root, over `mesh`, leaving `ignored` alone."""
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the loss carries the global normalisation
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
