"""`expert_parallel`: swap the MoE blocks of Hugging Face models for expert-parallel `MoELayer`s.

Called by the trainer on a built model (torchtitan style: the model code stays single-device).
Supported blocks (transformers 5.x, fused 3-D expert parameters): Qwen3-MoE, Qwen2-MoE
(sigmoid-gated shared expert), Mixtral and DeepSeek-V3 (sigmoid scores, correction bias,
group-limited top-k, routed scaling, shared experts). Each rank keeps only its contiguous
block of experts; the router and shared experts are the HF modules' own parameters, reused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from grpo_trainer.moe import autoselect
from grpo_trainer.moe.dispatch import Dispatcher, make_dispatcher
from grpo_trainer.moe.experts import GroupedExperts
from grpo_trainer.moe.layer import MoELayer, SharedForward
from grpo_trainer.moe.router import Router, RouterConfig


def _qwen2_shared(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    return F.sigmoid(layer.shared_expert_gate(x)) * layer.shared_expert(x)


def _deepseek_shared(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    return layer.shared_experts(x)


def _softmax_router(gate: nn.Module, norm: bool | None = None) -> RouterConfig:
    return RouterConfig(
        num_experts=gate.num_experts,
        top_k=gate.top_k,
        score_func="softmax",
        norm_topk_prob=gate.norm_topk_prob if norm is None else norm,
    )


def _deepseek_router(gate: nn.Module) -> RouterConfig:
    return RouterConfig(
        num_experts=gate.num_experts,
        top_k=gate.top_k,
        score_func="sigmoid",
        norm_topk_prob=gate.norm_topk_prob,
        num_groups=gate.num_group,
        topk_groups=gate.topk_group,
        scaling_factor=gate.routed_scaling_factor,
        score_bias=True,
    )


@dataclass(frozen=True)
class _Arch:
    router: Callable[[nn.Module], RouterConfig]
    shared: tuple[str, ...] = ()
    shared_forward: SharedForward | None = None


# HF MoE block class name → how to read its router and shared experts.
ARCHITECTURES: dict[str, _Arch] = {
    "Qwen3MoeSparseMoeBlock": _Arch(_softmax_router),
    "Qwen2MoeSparseMoeBlock": _Arch(_softmax_router, ("shared_expert", "shared_expert_gate"), _qwen2_shared),
    "MixtralSparseMoeBlock": _Arch(lambda gate: _softmax_router(gate, norm=True)),
    "DeepseekV3MoE": _Arch(_deepseek_router, ("shared_experts",), _deepseek_shared),
}


def ep_group_info(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, world, rank) with the default group filled in when torch.distributed is up."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


def _convert(
    block: nn.Module,
    arch: _Arch,
    dispatcher: Dispatcher,
    group: dist.ProcessGroup | None,
    world: int,
    rank: int,
) -> MoELayer:
    if getattr(block, "jitter_noise", 0.0):
        raise NotImplementedError("Mixtral router jitter noise is not supported under expert parallelism")
    config = arch.router(block.gate)
    if config.num_experts % world:
        raise ValueError(f"{config.num_experts} experts do not divide over an EP group of {world}")
    gate = Router(config, block.gate.weight.shape[1], weight=block.gate.weight)
    if config.score_bias:
        gate.e_score_correction_bias = block.gate.e_score_correction_bias
    local = config.num_experts // world
    lo, hi = rank * local, (rank + 1) * local
    experts = GroupedExperts(
        block.experts.gate_up_proj.detach()[lo:hi].clone(),
        block.experts.down_proj.detach()[lo:hi].clone(),
        num_experts=config.num_experts,
        first_expert=lo,
        group=group,
    )
    shared = {name: getattr(block, name) for name in arch.shared}
    return MoELayer(gate, experts, dispatcher, shared or None, arch.shared_forward)


def _dispatcher(
    backend: str, group: dist.ProcessGroup | None, block: nn.Module, tokens: int | None
) -> Dispatcher:
    """The block's backend, its buffers sized for `tokens` per dispatch; `auto` measures with the
    block's real shapes."""
    num_experts = block.gate.num_experts
    if backend != "auto":
        return make_dispatcher(backend, group, num_experts, tokens)
    shape = autoselect.EPShape(
        hidden=block.gate.weight.shape[1],
        top_k=block.gate.top_k,
        tokens=tokens or autoselect.EPShape().tokens,
    )
    return autoselect.auto_dispatcher(group, num_experts, shape)


def expert_parallel(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    aux_loss_coef: float = 0.0,
    tokens_per_batch: int | None = None,
) -> nn.Module:
    """Replace every supported HF MoE block of `model` in place; returns `model`.

    group: the expert-parallel group (default: the world, or EP = 1 without torch.distributed).
    backend: a registered dispatch backend (`local`, `nccl`, `gloo`, `deepep`, `auto`, ...).
    aux_loss_coef: > 0 makes each router keep a balancing loss (see `moe_aux_loss`); HF's own
        `output_router_logits` path is rejected because its hooks target the replaced routers.
    tokens_per_batch: tokens of one micro-batch on one rank (what one layer dispatches at once),
        for `auto`'s measurement (which also takes the blocks' hidden size and top-k) and the size
        of DeepEP's buffers; default `autoselect.EPShape().tokens` for `auto`, DeepEP's own cap.
    Call it before building the optimizer: expert parameters are new tensors.
    """
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        # HF records router logits with hooks on its own router class, which is replaced here.
        raise ValueError(
            "output_router_logits=True is not supported after expert_parallel: set it False, pass "
            "aux_loss_coef=config.router_aux_loss_coef and add grpo_trainer.moe.moe_aux_loss(model) "
            "to the loss"
        )
    group, world, rank = ep_group_info(group)
    if world == 1 and backend == "auto":
        backend = "local"
    dispatchers: dict[int, Dispatcher] = {}
    replaced = 0
    for name, block in list(model.named_modules()):
        arch = ARCHITECTURES.get(type(block).__name__)
        if arch is None:
            continue
        num_experts = block.gate.num_experts
        if num_experts not in dispatchers:
            dispatchers[num_experts] = _dispatcher(backend, group, block, tokens_per_batch)
        layer = _convert(block, arch, dispatchers[num_experts], group, world, rank)
        if aux_loss_coef:
            layer.gate.config = replace(layer.gate.config, aux_loss_coef=aux_loss_coef)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, layer)
        replaced += 1
    if not replaced:
        raise ValueError(
            f"no supported MoE block in {type(model).__name__}; supported: {sorted(ARCHITECTURES)}"
        )
    return model
