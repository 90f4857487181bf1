"""The `nccl` and `gloo` EP backends: dropless `all_to_all_single` with exchanged split sizes.

One dispatcher, registered under the name of the process-group backend it runs on: `nccl` for an
EP group on GPUs, `gloo` for one on CPUs (what `epBackend: nccl | gloo` asks for). Experts are
sharded in contiguous blocks (rank r owns experts [r*E_l, (r+1)*E_l)). Like DeepEP, a token
travels once to each rank that owns at least one of its top-k experts, with its slots' local
expert ids (-1 for slots owned elsewhere) and routing weights: with fine-grained routing
several of a token's experts share a rank, so this moves a fraction of the bytes that one
row per (token, expert) would. The receiver expands tokens into rows sorted by local expert
(no regrouping by source needed), sums a token's expert outputs before sending them back,
and the source sums the partial results of all ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from grpo_trainer.moe.dispatch import (
    BackendUnavailable,
    Dispatched,
    ExchangeClock,
    expand_by_local_expert,
    register_backend,
    sum_per_token,
)
from grpo_trainer.moe.layout import Layout, Requires


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, owner):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.owner = (out_splits, in_splits), group, owner
        return _exchange(x.contiguous(), out_splits, in_splits, group, owner)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return (
            _exchange(grad.contiguous(), in_splits, out_splits, ctx.group, ctx.owner),
            None,
            None,
            None,
            None,
        )


def _exchange(x, out_splits: list[int], in_splits: list[int], group, owner: AllToAllDispatcher):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with owner.clock.timing(x.device):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    owner.bytes_sent += (sum(in_splits) - in_splits[owner.rank]) * row_bytes
    return out


class _PackedAllToAll(torch.autograd.Function):
    """Rows, their routing weights and their local expert ids in one exchange (one sync point
    instead of three): packed as columns [hidden | weights | ids] of the rows' dtype when that
    holds the ids exactly (see `pack_dtype`), else of float32."""

    @staticmethod
    def forward(ctx, rows, weights, ids, out_splits, in_splits, group, owner):  # type: ignore[override]
        hidden, k = rows.shape[1], weights.shape[1]
        dtype = pack_dtype(rows.dtype, owner.num_local)
        send = rows.new_empty(rows.shape[0], hidden + 2 * k, dtype=dtype)
        send[:, :hidden] = rows
        send[:, hidden : hidden + k] = weights
        send[:, hidden + k :] = ids
        recv = _exchange(send, out_splits, in_splits, group, owner)
        ctx.meta = (hidden, k, out_splits, in_splits, group, owner, rows.dtype)
        recv_ids = recv[:, hidden + k :].round().long()
        ctx.mark_non_differentiable(recv_ids)
        return recv[:, :hidden].to(rows.dtype), recv[:, hidden : hidden + k].to(rows.dtype), recv_ids

    @staticmethod
    def backward(ctx, grad_rows, grad_weights, _):  # type: ignore[override]
        hidden, k, out_splits, in_splits, group, owner, dtype = ctx.meta
        grad = grad_rows.new_zeros(
            grad_rows.shape[0], hidden + 2 * k, dtype=pack_dtype(dtype, owner.num_local)
        )
        grad[:, :hidden] = grad_rows
        if grad_weights is not None:
            grad[:, hidden : hidden + k] = grad_weights
        back = _exchange(grad, in_splits, out_splits, group, owner)
        rows, weights = back[:, :hidden].to(dtype), back[:, hidden : hidden + k].to(dtype)
        return rows, weights, None, None, None, None, None


def pack_dtype(dtype: torch.dtype, num_local: int) -> torch.dtype:
    """`dtype` if it represents local expert ids in [-1, num_local) exactly, else float32."""
    exact = {torch.float64: 2**53, torch.float32: 2**24, torch.float16: 2**11, torch.bfloat16: 2**8}
    return dtype if num_local <= exact.get(dtype, 0) else torch.float32


def _on(device: str, backend: str) -> Requires:
    def requires(layout: Layout, num_experts: int) -> str | None:
        if layout.device != device:
            return f"the EP group is on {layout.device}, {backend} all-to-all runs on {device}"
        if num_experts % layout.size:
            return f"{num_experts} experts do not divide over {layout.size} ranks"
        return None

    return requires


class AllToAllDispatcher:
    """Dropless expert parallelism over `group`, each token sent once per destination rank.
    No buffers: `tokens` is taken for the factory interface and not needed."""

    name = ""
    """The process-group backend it must run on (the registered name)."""

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, tokens: int | None = None) -> None:
        if (runs_on := dist.get_backend(group)) != self.name:
            raise BackendUnavailable(
                f"epBackend {self.name}: the EP group runs on {runs_on}; set spec.trainer.epBackend to "
                f"{runs_on if runs_on in ('nccl', 'gloo') else 'auto'} or auto"
            )
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts do not divide over {self.world} ranks")
        self.num_experts = num_experts
        self.num_local = num_experts // self.world
        self.bytes_sent = 0
        self.clock = ExchangeClock()

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        num_tokens, k = topk_idx.shape
        dest = topk_idx // self.num_local  # (T, K) owning rank of each slot
        in_rank = torch.zeros(num_tokens, self.world, dtype=torch.bool, device=x.device)
        in_rank.scatter_(1, dest, True)
        dest_rank, send_tokens = in_rank.t().nonzero(as_tuple=True)  # (S,) by rank, then token
        send_counts = in_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        slots = topk_idx.index_select(0, send_tokens)  # (S, K) global expert ids
        on_dest = slots // self.num_local == dest_rank.unsqueeze(1)
        send_idx = torch.where(on_dest, slots - dest_rank.unsqueeze(1) * self.num_local, -1)
        send_weights = topk_weights.index_select(0, send_tokens) * on_dest
        recv_x, recv_weights, recv_idx = _PackedAllToAll.apply(  # (R, H), (R, K), (R, K) local ids
            x.index_select(0, send_tokens), send_weights, send_idx, recv_splits, send_splits, self.group, self
        )
        order, counts = expand_by_local_expert(recv_idx, self.num_local)
        token = order // k
        rows = recv_x.index_select(0, token)
        weights = recv_weights.reshape(-1).index_select(0, order)
        handle = (token, recv_x.shape[0], send_tokens, num_tokens, send_splits, recv_splits)
        return Dispatched(rows, counts, weights, handle)

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        token, num_recv, send_tokens, num_tokens, send_splits, recv_splits = handle
        partial = sum_per_token(rows, token, num_recv)  # one row per received token
        back = _AllToAll.apply(partial, send_splits, recv_splits, self.group, self)
        return sum_per_token(back, send_tokens, num_tokens)


@register_backend("nccl", requires=_on("cuda", "nccl"))
class NcclAllToAll(AllToAllDispatcher):
    name = "nccl"


@register_backend("gloo", requires=_on("cpu", "gloo"))
class GlooAllToAll(AllToAllDispatcher):
    name = "gloo"
