"""The `deepep` EP backend: DeepEP `Buffer` normal (high-throughput) mode, NVLink and RDMA/EFA.

Registered in `grpo_trainer.moe.dispatch` only when `deep_ep` imports (GPU images); nothing
here runs on the CPU machines. DeepEP sends a token once per destination rank (not once per
chosen expert), with its top-k ids translated to local expert ids (-1 elsewhere) and its
weights. This rank expands the received tokens into rows grouped by local expert (the experts
apply the routing weights), sums a token's rows, and DeepEP's combine adds the partial sums
of all ranks. Backward of dispatch is combine with the same handle (which also reduces the
weight gradients); backward of combine is a cached dispatch with that handle.
DeepEP moves bf16 only: rows travel in bf16 and are cast back to the layer's dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from grpo_trainer.moe.dispatch import (
    Dispatched,
    ExchangeClock,
    expand_by_local_expert,
    register_backend,
    sum_per_token,
)

try:
    from deep_ep import Buffer
except ImportError:  # CPU images: the backend is simply not registered
    Buffer = None

_BUFFERS: dict[tuple[int, int], Any] = {}


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> Any:
    """One DeepEP buffer per (group, row width), sized by DeepEP's own hints."""
    key = id(group)
    cached = _BUFFERS.get((key, hidden_bytes))
    if cached is not None:
        return cached
    size = group.size()
    nvl_bytes = rdma_bytes = 0
    for config in (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size)):
        nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, size), nvl_bytes)
        rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, size), rdma_bytes)
    buffer = Buffer(group, nvl_bytes, rdma_bytes)
    _BUFFERS[(key, hidden_bytes)] = buffer
    return buffer


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, buffer, num_experts, meta, clock):  # type: ignore[override]
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        with clock.timing(x.device):
            recv_x, recv_idx, recv_weights, _, handle, _ = buffer.dispatch(
                x,
                topk_idx=topk_idx,
                topk_weights=topk_weights,
                num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
            )
        ctx.buffer, ctx.handle, ctx.clock = buffer, handle, clock
        meta["handle"], meta["recv_idx"] = handle, recv_idx
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_x, grad_weights):  # type: ignore[override]
        weights = None if grad_weights is None else grad_weights.float().contiguous()
        with ctx.clock.timing(grad_x.device):
            grad_x, grad_weights, _ = ctx.buffer.combine(
                grad_x.contiguous(), ctx.handle, topk_weights=weights
            )
        return grad_x, grad_weights, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer, handle, clock):  # type: ignore[override]
        with clock.timing(x.device):
            combined, _, _ = buffer.combine(x, handle)
        ctx.buffer, ctx.handle, ctx.clock = buffer, handle, clock
        return combined

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with ctx.clock.timing(grad.device):
            grad_x, _, _, _, _, _ = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_x, None, None, None


class DeepEPDispatcher:
    """Expert parallelism through DeepEP; experts sharded in contiguous blocks like `alltoall`."""

    name = "deepep"

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts do not divide over {self.world} ranks")
        self.num_experts = num_experts
        self.num_local = num_experts // self.world
        self.bytes_sent = 0
        self.clock = ExchangeClock()

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        dtype = x.dtype
        send = x.to(torch.bfloat16).contiguous()
        buffer = get_buffer(self.group, send.shape[1] * send.element_size())
        meta: dict[str, Any] = {}
        recv_x, recv_weights = _Dispatch.apply(
            send, topk_weights.float(), topk_idx.to(torch.int64), buffer, self.num_experts, meta, self.clock
        )
        recv_idx = meta["recv_idx"]  # (R, K) local expert ids, -1 where not on this rank
        order, counts = expand_by_local_expert(recv_idx, self.num_local)
        token = order // recv_idx.shape[1]
        rows = recv_x.index_select(0, token).to(dtype)
        weights = recv_weights.reshape(-1).index_select(0, order)
        self.bytes_sent += send.numel() * send.element_size()  # upper bound: local tokens counted too
        handle = (buffer, meta["handle"], token, recv_x.shape[0])
        return Dispatched(rows, counts, weights, handle)

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        buffer, deepep_handle, token, num_recv = handle
        partial = sum_per_token(rows, token, num_recv).to(torch.bfloat16)
        self.bytes_sent += partial.numel() * partial.element_size()
        combined = _Combine.apply(partial, buffer, deepep_handle, self.clock)
        return combined.to(rows.dtype)


if Buffer is not None:
    register_backend("deepep")(DeepEPDispatcher)
