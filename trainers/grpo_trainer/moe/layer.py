"""The expert-parallel MoE block: router → dispatch → local grouped experts → combine (+ shared).

Built by `grpo_trainer.moe.hf.expert_parallel` from a Hugging Face MoE block, or directly by
a model of our own. Parameter names follow the HF blocks (`gate.weight`, `experts.gate_up_proj`,
`experts.down_proj`, shared expert modules under their HF names), so a state dict differs from
the unsharded model's only in the first dimension of the two expert tensors.

Routing replay: set `replay_idx` (T, K) before a forward to reuse a recorded expert choice;
`last_topk_idx` holds the choice of the latest forward for recording.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from grpo_trainer.moe.dispatch import Dispatcher
from grpo_trainer.moe.experts import GroupedExperts
from grpo_trainer.moe.router import Router

SharedForward = Callable[["MoELayer", torch.Tensor], torch.Tensor]


def _compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype when autocast is on (the residual stream stays fp32 under autocast,
    but the experts should compute, and the all-to-all move rows, in bf16); else unchanged."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class MoELayer(nn.Module):
    """One MoE block sharded over an expert-parallel group; input and output (..., H)."""

    def __init__(
        self,
        gate: Router,
        experts: GroupedExperts,
        dispatcher: Dispatcher,
        shared: dict[str, nn.Module] | None = None,
        shared_forward: SharedForward | None = None,
    ) -> None:
        super().__init__()
        if experts.num_experts != gate.config.num_experts:
            raise ValueError("router and experts disagree on the number of experts")
        if bool(shared) != (shared_forward is not None):
            raise ValueError("shared modules and shared_forward go together")
        self.gate = gate
        self.experts = experts
        self.dispatcher = dispatcher
        for name, module in (shared or {}).items():
            self.add_module(name, module)
        self.shared_forward = shared_forward
        self.replay_idx: torch.Tensor | None = None
        self.last_topk_idx: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (T, H)
        _, topk_weights, topk_idx = self.gate(x, self.replay_idx)  # (T, K) each
        self.last_topk_idx = topk_idx.detach()
        sent = self.dispatcher.dispatch(
            _compute_dtype(x), topk_idx, topk_weights
        )  # rows (N, H) by local expert
        rows = self.experts(sent.rows, sent.counts, sent.weights)  # weighted expert outputs (N, H)
        out = self.dispatcher.combine(rows, sent.handle).to(x.dtype)  # (T, H)
        if self.shared_forward is not None:
            out = out + self.shared_forward(self, x)
        return out.reshape(shape)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The model's MoE layers in module order (the order routing replay uses)."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def exchange_seconds(model: nn.Module) -> float:
    """Seconds the model's MoE layers spent in dispatch/combine exchanges since the last call."""
    return sum(layer.dispatcher.clock.take() for layer in moe_layers(model))


def moe_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """Sum of the routers' balancing losses of the latest training forward, or None."""
    losses = [m.gate.aux_loss for m in moe_layers(model) if m.gate.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def set_routing_replay(model: nn.Module, topk_idx: list[torch.Tensor] | None) -> None:
    """Replay one (T, K) expert choice per MoE layer on the next forwards; None stops replay."""
    layers = moe_layers(model)
    if topk_idx is not None and len(topk_idx) != len(layers):
        raise ValueError(f"{len(topk_idx)} routing tensors for {len(layers)} MoE layers")
    for i, layer in enumerate(layers):
        layer.replay_idx = None if topk_idx is None else topk_idx[i]


@contextlib.contextmanager
def replaying(model: nn.Module, topk_idx: list[torch.Tensor] | None) -> Iterator[None]:
    """Replay `topk_idx` (see `set_routing_replay`) for the forwards inside the block only, so no
    later forward reuses choices made for another batch's tokens; None replays nothing."""
    set_routing_replay(model, topk_idx)
    try:
        yield
    finally:
        set_routing_replay(model, None)


def recorded_routing(model: nn.Module) -> list[torch.Tensor]:
    """Each MoE layer's expert choice (T, K) of the latest forward."""
    return [m.last_topk_idx for m in moe_layers(model) if m.last_topk_idx is not None]
