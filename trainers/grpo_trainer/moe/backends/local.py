"""The `local` EP backend: EP = 1, every expert on this rank; the numerical reference of the others."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from grpo_trainer.moe.dispatch import (
    Dispatched,
    ExchangeClock,
    register_backend,
    sort_by_expert,
    sum_per_token,
)


@register_backend("local")
class LocalDispatcher:
    """EP = 1: all experts are here; dispatch is one sort and gather, combine one scatter-add.
    No buffers: `tokens` is taken for the factory interface and not needed."""

    name = "local"

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, tokens: int | None = None) -> None:
        if group is not None and dist.get_world_size(group) != 1:
            raise ValueError("the local backend needs a group of one rank")
        self.num_experts = num_experts
        self.bytes_sent = 0
        self.clock = ExchangeClock()  # never ticks: nothing leaves the rank

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        order, counts = sort_by_expert(topk_idx, self.num_experts)
        token = order // topk_idx.shape[1]
        weights = topk_weights.reshape(-1).index_select(0, order)
        return Dispatched(x.index_select(0, token), counts.tolist(), weights, (token, x.shape[0]))

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        return sum_per_token(rows, *handle)
