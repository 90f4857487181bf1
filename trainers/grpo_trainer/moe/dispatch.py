"""The dispatch/combine interface of the expert-parallel layer and the registry of its backends.

Called by `grpo_trainer.moe.layer.MoELayer`: `dispatch` moves each token's hidden state to the
ranks that own its top-k experts and returns rows grouped by local expert, each with its
routing weight; the layer's experts apply the weights; `combine` brings the weighted expert
outputs home and sums them per token. Both are differentiable, weights included. A backend
is one file in `grpo_trainer.moe.backends` whose class (or factory) is decorated with
`@register_backend(name, requires=...)`; the registry imports that package at the first lookup.
`requires(layout, num_experts)` says why the backend cannot work on a layout (None: it can) and
makes it a candidate of `auto`. `local` (EP = 1, no communication) is the numerical reference the
others are tested against. The GRPOJob's `epBackend` values are registry names
(`tests/unit/test_mirrors.py`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from grpo_wire.registry import Registry

from grpo_trainer.moe.layout import Requires


@dataclass
class Dispatched:
    """What a rank's experts receive."""

    rows: torch.Tensor
    """(N, H) hidden states, grouped by local expert."""
    counts: list[int]
    """Rows per local expert; sums to N."""
    weights: torch.Tensor
    """(N,) routing weight of each row (differentiable back to the router)."""
    handle: Any
    """Backend state that `combine` needs (orders, splits, weights)."""


@dataclass
class ExchangeClock:
    """Seconds a backend spends exchanging tokens with other ranks, forward and backward.

    Wall time on CPU (gloo's collectives return when done); CUDA events on GPU, resolved only
    in `take`, so keeping time never adds a host sync inside a step."""

    _seconds: float = 0.0
    _events: list[tuple[Any, Any]] = field(default_factory=list)

    @contextlib.contextmanager
    def timing(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
            return
        began = time.perf_counter()
        try:
            yield
        finally:
            self._seconds += time.perf_counter() - began

    def take(self) -> float:
        """Seconds since the last take (waits for pending GPU exchanges to finish)."""
        for start, end in self._events:
            end.synchronize()
            self._seconds += start.elapsed_time(end) / 1e3
        seconds, self._seconds, self._events = self._seconds, 0.0, []
        return seconds


class Dispatcher(Protocol):
    """One way of moving tokens to experts and back."""

    name: str
    bytes_sent: int
    """Bytes this rank has sent to other ranks so far (forward and backward)."""
    clock: ExchangeClock
    """Time this rank has spent in those exchanges (`exchange_seconds` reads it per step)."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """x (T, H), topk_idx (T, K) global expert ids, topk_weights (T, K) → rows for local experts."""
        ...

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        """Weighted expert outputs (N, H) in dispatched order → (T, H) sum per token."""
        ...


BackendFactory = Callable[..., Dispatcher]
"""(group, num_experts, tokens=None) → a dispatcher; `tokens` is what one dispatch carries per rank
(a micro-batch's tokens), for backends that size buffers by it; None when unknown."""


@dataclass(frozen=True)
class Backend:
    """A registered EP backend: how to build it and, for `auto`, where it can work."""

    build: BackendFactory
    requires: Requires | None = None
    """Why it cannot work on a layout, or None; a backend without one is never an `auto` candidate."""


BACKENDS: Registry[Backend] = Registry("EP backend", home="grpo_trainer.moe.backends")


class BackendUnavailable(RuntimeError):
    """The EP backend asked for by name cannot serve this group here (not installed, its import
    refused, no CUDA, a layout it does not take): a restart cannot fix it."""


def register_backend(
    name: str, requires: Requires | None = None
) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: make the factory the EP backend `name` (an `auto` candidate where `requires` allows)."""

    def deco(factory: BackendFactory) -> BackendFactory:
        BACKENDS.register(name)(Backend(factory, requires))
        return factory

    return deco


def available_backends() -> list[str]:
    return BACKENDS.names()


def make_dispatcher(
    name: str, group: dist.ProcessGroup | None, num_experts: int, tokens: int | None = None
) -> Dispatcher:
    """Build the backend `name` for `num_experts` routed experts sharded evenly over `group`;
    `tokens`: tokens per rank one dispatch carries (buffers are sized by it), None when unknown."""
    return BACKENDS.get(name).build(group, num_experts, tokens=tokens)


def sort_by_expert(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable order of the flattened (token, slot) pairs by expert id, and the count per expert."""
    flat = topk_idx.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def expand_by_local_expert(recv_idx: torch.Tensor, num_local: int) -> tuple[torch.Tensor, list[int]]:
    """Received tokens with their local expert ids (R, K), -1 where a slot lives elsewhere →
    the order of the valid (token, slot) pairs sorted by local expert, and rows per expert."""
    key = torch.where(recv_idx >= 0, recv_idx, num_local).reshape(-1)
    order = torch.sort(key, stable=True)[1]
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local].tolist()
    return order[: sum(counts)], counts


def sum_per_token(rows: torch.Tensor, token: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(N, H) rows, row i belonging to token[i] → (T, H) sums."""
    return rows.new_zeros(num_tokens, rows.shape[1]).index_add(0, token, rows)
