"""DeepEP behind the Dispatcher interface: the part DeepEP v1 (`Buffer`) and v2 (`ElasticBuffer`) share.

The versions live in `grpo_trainer.moe.deepep_v1` (inside one NVLink node) and
`grpo_trainer.moe.deepep_v2` (EP groups across EFA nodes, over NCCL GIN); each registers itself,
and `deepep_dispatcher` as `deepep`, only when its `deep_ep` class imports, so nothing here runs
or registers on the CPU machines. `deepep` (the GRPOJob's `epBackend: deepep`) picks v1 for a
group inside one node and v2 for one that spans nodes, and says why when that one is missing.

Both versions send a token once per destination rank (not once per chosen expert), with its
top-k ids translated to local expert ids (-1 elsewhere) and its weights, and report the rows
each local expert receives (a host-side list DeepEP computes during its own CPU sync: used as
is, so the layer adds no host sync of its own). This rank expands the received tokens into rows
grouped by local expert (the experts apply the routing weights), sums a token's rows, and
DeepEP's combine adds the partial sums of all ranks. Backward of dispatch is combine with the
same handle (which also reduces the weight gradients); backward of combine is a dispatch with
that handle. DeepEP moves bf16 rows (combine is bf16 only); see `row_dtype` for what the
experts get.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from grpo_trainer.moe.dispatch import Dispatched, ExchangeClock, sum_per_token


class Exchange(Protocol):
    """One DeepEP version's calls, in the shape this module needs."""

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
        """bf16 x (T, H), int64 ids, fp32 weights → recv_x, recv local ids, recv weights,
        rows per local expert (host list), handle."""
        ...

    def redispatch(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        """Dispatch with a cached handle (backward of combine)."""
        ...

    def combine(
        self, x: torch.Tensor, handle: Any, topk_weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """bf16 partial sums (R, H) → (T, H) sums (and reduced weights when given)."""
        ...


def row_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts get DeepEP's bf16 rows in: bf16 under bf16 autocast (the expert GEMMs
    run in bf16 there anyway, so casting back to the fp32 input dtype only costs memory and
    bandwidth), else the input's dtype (numerics as without DeepEP)."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16:
        return torch.bfloat16
    return x.dtype


def local_expert_order(recv_idx: torch.Tensor, counts: list[int], num_local: int) -> torch.Tensor:
    """Received (R, K) local expert ids, -1 elsewhere, and DeepEP's rows per local expert → the
    valid (token, slot) pairs sorted by local expert. No host sync: the length is the host sum."""
    key = torch.where(recv_idx >= 0, recv_idx, num_local).reshape(-1)
    return torch.sort(key, stable=True)[1][: sum(counts)]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, exchange, num_experts, meta, clock):  # type: ignore[override]
        with clock.timing(x.device):
            recv_x, recv_idx, recv_weights, counts, handle = exchange.dispatch(
                x, topk_idx, topk_weights, num_experts
            )
        ctx.exchange, ctx.handle, ctx.clock = exchange, handle, clock
        meta.update(handle=handle, recv_idx=recv_idx, counts=counts)  # not outputs: no gradient
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_x, grad_weights):  # type: ignore[override]
        weights = None if grad_weights is None else grad_weights.float().contiguous()
        with ctx.clock.timing(grad_x.device):
            grad_x, grad_weights = ctx.exchange.combine(
                grad_x.to(torch.bfloat16).contiguous(), ctx.handle, topk_weights=weights
            )
        return grad_x, grad_weights, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, exchange, handle, clock):  # type: ignore[override]
        with clock.timing(x.device):
            combined, _ = exchange.combine(x, handle)
        ctx.exchange, ctx.handle, ctx.clock = exchange, handle, clock
        return combined

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with ctx.clock.timing(grad.device):
            grad_x = ctx.exchange.redispatch(grad.to(torch.bfloat16).contiguous(), ctx.handle)
        return grad_x, None, None, None


def release_exchanges(cache: dict, group: object) -> None:
    """Drop the cached exchanges of `group` (keys start with its id); DeepEP frees a buffer with
    its last reference, so nothing else is asked of it."""
    for key in [k for k in cache if k[0] == id(group)]:
        del cache[key]


class DeepEPDispatcher:
    """Expert parallelism through one DeepEP version (`exchange`); experts sharded in contiguous
    blocks like `alltoall`. Subclasses build the exchange lazily (DeepEP's constructors are
    collective and size their buffers by the row width of the first dispatch)."""

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

    def exchange(self, hidden: int, top_k: int) -> Exchange:
        raise NotImplementedError

    def release(self) -> None:
        """Drop this group's DeepEP buffers (called on every rank when `auto` chose another backend)."""

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        send = x.to(torch.bfloat16).contiguous()  # DeepEP moves bf16 rows
        exchange = self.exchange(send.shape[1], topk_idx.shape[1])
        meta: dict[str, Any] = {}
        recv_x, recv_weights = _Dispatch.apply(
            send, topk_weights.float(), topk_idx.to(torch.int64), exchange, self.num_experts, meta, self.clock
        )
        recv_idx, counts = meta["recv_idx"], list(meta["counts"])  # (R, K) local ids; rows per expert
        order = local_expert_order(recv_idx, counts, self.num_local)
        token = order // recv_idx.shape[1]
        rows = recv_x.index_select(0, token).to(row_dtype(x))
        weights = recv_weights.reshape(-1).index_select(0, order)
        self.bytes_sent += send.numel() * send.element_size()  # upper bound: local tokens counted too
        return Dispatched(rows, counts, weights, (exchange, meta["handle"], token, recv_x.shape[0]))

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        exchange, deepep_handle, token, num_recv = handle
        partial = sum_per_token(rows, token, num_recv).to(torch.bfloat16)
        self.bytes_sent += partial.numel() * partial.element_size()
        combined = _Combine.apply(partial, exchange, deepep_handle, self.clock)
        return combined.to(rows.dtype)  # the layer casts to its input's dtype


def spans_nodes(group: dist.ProcessGroup, ranks_per_node: int | None = None) -> bool:
    """Whether the EP group's ranks sit on more than one node (see `autoselect.Layout`)."""
    from grpo_trainer.moe import autoselect

    return autoselect.layout_of(group, ranks_per_node).spans_nodes


def deepep_dispatcher(group: dist.ProcessGroup | None, num_experts: int) -> DeepEPDispatcher:
    """`epBackend: deepep`: v1 inside one node, v2 across nodes; a clear error when that one is missing."""
    from grpo_trainer.moe import deepep_v1, deepep_v2

    group = group if group is not None else dist.group.WORLD
    version = deepep_v2 if spans_nodes(group) else deepep_v1
    if not version.AVAILABLE:
        raise RuntimeError(f"epBackend deepep needs {version.NAME} here, which is missing: {version.WHY}")
    return version.Dispatcher(group, num_experts)
