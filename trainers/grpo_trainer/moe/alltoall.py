"""The `alltoall` EP backend: dropless `all_to_all_single` with exchanged split sizes.

Registered in `grpo_trainer.moe.dispatch`; runs on gloo (CPU) and NCCL (GPU). Experts are
sharded in contiguous blocks (rank r owns experts [r*E_l, (r+1)*E_l)), so sorting a rank's
(token, slot) pairs by global expert id also groups them by destination rank. One small
all-to-all exchanges the per-expert counts, one large one moves the rows; received rows come
grouped by source rank and are regrouped by local expert with a single gather; the routing
weights travel alongside (one float per row). Combine runs the inverse and sums per token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from grpo_trainer.moe.dispatch import Dispatched, register_backend, sort_by_expert, sum_per_token


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
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    owner.bytes_sent += (sum(in_splits) - in_splits[owner.rank]) * row_bytes
    return out


def regroup_index(counts: torch.Tensor) -> torch.Tensor:
    """Gather index turning rows laid out [source][expert] into [expert][source].

    counts (S, E) holds rows per (source, expert) block in the received layout.
    """
    lengths = counts.reshape(-1)
    starts = torch.cumsum(lengths, 0) - lengths  # block starts in received order
    starts_t = starts.view_as(counts).t().reshape(-1)  # in target order
    lengths_t = counts.t().reshape(-1)
    offsets_t = torch.cumsum(lengths_t, 0) - lengths_t
    total = int(lengths.sum())
    shift = torch.repeat_interleave(starts_t - offsets_t, lengths_t, output_size=total)
    return torch.arange(total, dtype=torch.int64) + shift


@register_backend("alltoall")
class AllToAllDispatcher:
    """Dropless expert parallelism over `group` with two all-to-alls per direction."""

    name = "alltoall"

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts do not divide over {self.world} ranks")
        self.num_experts = num_experts
        self.num_local = num_experts // self.world
        self.bytes_sent = 0

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        order, counts = sort_by_expert(topk_idx, self.num_experts)  # counts (E,)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [source][local expert]
        send_splits = counts.view(self.world, self.num_local).sum(1).tolist()
        recv_matrix = recv_counts.view(self.world, self.num_local)
        recv_splits = recv_matrix.sum(1).tolist()
        token = order // topk_idx.shape[1]
        send = x.index_select(0, token)  # (T*K, H) grouped by destination rank
        recv = _AllToAll.apply(send, recv_splits, send_splits, self.group, self)
        weights = topk_weights.reshape(-1).index_select(0, order)
        weights = _AllToAll.apply(weights, recv_splits, send_splits, self.group, self)
        index = None
        if self.world > 1 and self.num_local > 1:
            index = regroup_index(recv_matrix.cpu()).to(x.device)
            recv, weights = recv.index_select(0, index), weights.index_select(0, index)
        handle = (token, x.shape[0], send_splits, recv_splits, index)
        return Dispatched(recv, recv_matrix.sum(0).tolist(), weights, handle)

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        token, num_tokens, send_splits, recv_splits, index = handle
        if index is not None:
            rows = torch.empty_like(rows).index_copy(0, index, rows)  # back to [source][expert]
        back = _AllToAll.apply(rows, send_splits, recv_splits, self.group, self)
        return sum_per_token(back, token, num_tokens)
