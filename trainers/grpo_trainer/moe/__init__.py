"""Expert-parallel Mixture-of-Experts layer: router, dispatch/combine backends, grouped experts.

Public API (stable; the trainer, checkpoints and weight sync use it):

    from grpo_trainer import moe

    moe.expert_parallel(model, group=None, backend="auto", aux_loss_coef=0.0) -> model
        Replace the MoE blocks of an HF Qwen3-MoE / Qwen2-MoE / Mixtral / DeepSeek-V3 model in
        place by `MoELayer`s sharded over `group` (default: the world; EP = 1 without
        torch.distributed). Each rank keeps experts [r*E/ep, (r+1)*E/ep). Numerics unchanged.
        Backends: "local" (EP = 1), "nccl" / "gloo" (all_to_all_single on that group), "deepep"
        (when deep_ep is installed), "auto" (measured choice); one file each in `moe/backends/`.
        Build the optimizer afterwards.
    moe.load_checkpoint(model, path)
        Fill an expert-parallel model from HF safetensors, reading only the local experts.
    moe.full_state_dict(model) / moe.iter_full_state_dict(model)
        Collective: the unsharded state dict (HF in-memory names and shapes) for saving
        (e.g. `model.save_pretrained(d, state_dict=...)` on rank 0) and for weight sync.
    moe.set_routing_replay(model, [topk_idx per layer] | None), moe.recorded_routing(model)
        Routing replay: reuse the rollout engine's expert choices; read the latest choices.
    with moe.replaying(model, [topk_idx per layer] | None): ...
        Routing replay for the forwards inside the block only.
    moe.exchange_seconds(model)
        Seconds spent in dispatch/combine exchanges (forward and backward) since the last call.
    moe.moe_aux_loss(model)
        Sum of the routers' load-balancing losses of the last training forward (or None).
    moe.MoELayer, moe.Router, moe.RouterConfig, moe.GroupedExperts, moe.make_dispatcher,
    moe.register_backend, moe.available_backends
        Building blocks for models of our own and for new backends.

Model code stays single-device: nothing here is imported by a model definition.
"""

from grpo_trainer.moe.checkpoint import full_state_dict, iter_full_state_dict, load_checkpoint
from grpo_trainer.moe.dispatch import (
    BackendUnavailable,
    Dispatched,
    Dispatcher,
    available_backends,
    make_dispatcher,
    register_backend,
)
from grpo_trainer.moe.experts import GroupedExperts, grouped_swiglu
from grpo_trainer.moe.hf import ARCHITECTURES, expert_parallel
from grpo_trainer.moe.layer import (
    MoELayer,
    exchange_seconds,
    moe_aux_loss,
    moe_layers,
    recorded_routing,
    replaying,
    set_routing_replay,
)
from grpo_trainer.moe.router import Router, RouterConfig, load_balancing_loss

__all__ = [
    "ARCHITECTURES",
    "BackendUnavailable",
    "Dispatched",
    "Dispatcher",
    "GroupedExperts",
    "MoELayer",
    "Router",
    "RouterConfig",
    "available_backends",
    "exchange_seconds",
    "expert_parallel",
    "full_state_dict",
    "grouped_swiglu",
    "iter_full_state_dict",
    "load_balancing_loss",
    "load_checkpoint",
    "make_dispatcher",
    "moe_aux_loss",
    "moe_layers",
    "recorded_routing",
    "register_backend",
    "replaying",
    "set_routing_replay",
]
