"""The dispatch/combine interface of the expert-parallel layer, its registry and the local backend.

Called by `grpo_trainer.moe.layer.MoELayer`: `dispatch` moves each token's hidden state to the
ranks that own its top-k experts and returns rows grouped by local expert; the layer runs its
experts on them; `combine` brings the expert outputs home and sums them per token, weighted
by the routing weights (a backend may apply the weights on either side). Both are
differentiable. A backend is one small class registered here with `register_backend`;
`local` (EP = 1, no communication) is the numerical reference the others are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


@dataclass
class Dispatched:
    """What a rank's experts receive."""

    rows: torch.Tensor
    """(N, H) hidden states, grouped by local expert."""
    counts: list[int]
    """Rows per local expert; sums to N."""
    handle: Any
    """Backend state that `combine` needs (orders, splits, weights)."""


class Dispatcher(Protocol):
    """One way of moving tokens to experts and back."""

    name: str
    bytes_sent: int
    """Bytes this rank has sent to other ranks so far (forward and backward)."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """x (T, H), topk_idx (T, K) global expert ids, topk_weights (T, K) → rows for local experts."""
        ...

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        """Expert outputs (N, H) in dispatched order → (T, H) weighted sum per token."""
        ...


BackendFactory = Callable[[dist.ProcessGroup | None, int], Dispatcher]
_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Class decorator: make `name` available to `make_dispatcher` and `expert_parallel`."""

    def deco(factory: BackendFactory) -> BackendFactory:
        _BACKENDS[name] = factory
        return factory

    return deco


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def make_dispatcher(name: str, group: dist.ProcessGroup | None, num_experts: int) -> Dispatcher:
    """Build the backend `name` for `num_experts` routed experts sharded evenly over `group`."""
    # Importing the modules registers their backends; deepep registers only when deep_ep imports.
    import grpo_trainer.moe.alltoall
    import grpo_trainer.moe.autoselect
    import grpo_trainer.moe.deepep  # noqa: F401

    if name not in _BACKENDS:
        raise ValueError(f"unknown EP backend {name!r}; available: {available_backends()}")
    return _BACKENDS[name](group, num_experts)


def sort_by_expert(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of the flattened (token, slot) pairs by expert id, and the count per expert."""
    flat = topk_idx.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def weighted_sum(rows: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Rows in `order` (one per (token, slot)) → (T, H) sum over slots weighted by the routing."""
    num_tokens, k = topk_weights.shape
    weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = rows.new_zeros(num_tokens, rows.shape[1])
    return out.index_add(0, order // k, rows * weights)


@register_backend("local")
class LocalDispatcher:
    """EP = 1: all experts are here; dispatch is one sort, combine one weighted scatter-add."""

    name = "local"

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int) -> None:
        if group is not None and dist.get_world_size(group) != 1:
            raise ValueError("the local backend needs a group of one rank")
        self.num_experts = num_experts
        self.bytes_sent = 0

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        order, counts = sort_by_expert(topk_idx, self.num_experts)
        rows = x.index_select(0, order // topk_idx.shape[1])
        return Dispatched(rows, counts.tolist(), (order, topk_weights))

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        order, topk_weights = handle
        return weighted_sum(rows, order, topk_weights)
