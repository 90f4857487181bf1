"""DeepEP behind the Dispatcher interface: the part DeepEP v1 (`Buffer`) and v2 (`ElasticBuffer`) share.

The versions are backends of their own, `grpo_trainer.moe.backends.deepep_v1` (inside one NVLink
node) and `...deepep_v2` (EP groups across EFA nodes, over NCCL GIN), always registered and offered
to `auto`, which their `requires` refuses with the import's reason where their `deep_ep` class does
not import (`grpo_wire.deepep_import`: a DeepEP that fails its own import checks raises
AssertionError, not ImportError, and must not crash registration). `deepep` (the GRPOJob's
`epBackend: deepep`, `backends/deepep.py`) picks v1 for a group inside one node and v2 for one that
spans nodes, and fails naming the component and what to change when that one cannot serve the group.

Both versions send a token once per destination rank (not once per chosen expert), with its
top-k ids translated to local expert ids (-1 elsewhere) and its weights, and report the rows
each local expert receives (a host-side list DeepEP computes during its own CPU sync: used as
is, so the layer adds no host sync of its own). This rank expands the received tokens into rows
grouped by local expert (the experts apply the routing weights), sums a token's rows, and
DeepEP's combine adds the partial sums of all ranks. Backward of dispatch is combine with the
same handle (which also reduces the weight gradients); backward of combine is a dispatch with
that handle. DeepEP moves bf16 rows (combine is bf16 only); see `row_dtype` for what the
experts get.

A buffer holds at most `Exchange.max_tokens` tokens per rank (v2; v1 pipelines any count). A
layer that sees more is dispatched in chunks, as many on every rank of the group (the count is
agreed with one all-reduce of the token count), each chunk's rows merged into one set grouped
by local expert, so the experts still run once per layer.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Protocol

import torch
import torch.distributed as dist

from grpo_trainer.moe.dispatch import BackendUnavailable, Dispatched, ExchangeClock, sum_per_token

log = logging.getLogger(__name__)


def comm_ptr_problem(comm_ptr: int | None, reuse_torch_comm: bool) -> str | None:
    """Why DeepEP v2 cannot use the EP group's NCCL communicator, or None (pure). v2 reuses the
    group's communicator through `_comm_ptr()`, which is 0 while torch has not created it (a
    group made without `device_id` creates it at its first collective)."""
    if not reuse_torch_comm or comm_ptr is None:
        return None  # DeepEP then creates a communicator of its own
    if comm_ptr == 0:
        return (
            "the EP group's NCCL communicator does not exist yet (_comm_ptr() is 0): create the group "
            "with device_id (grpo_trainer.parallel.make_groups does on CUDA) or run one collective on it "
            "before building a DeepEP buffer"
        )
    return None


def check_communicator(group: dist.ProcessGroup) -> None:
    """Raise before DeepEP v2 builds a buffer over a communicator that does not exist yet."""
    backend = group._get_backend(torch.device("cuda"))
    ptr = backend._comm_ptr() if hasattr(backend, "_comm_ptr") else None
    problem = comm_ptr_problem(ptr, os.environ.get("EP_REUSE_NCCL_COMM", "1") != "0")
    if problem:
        raise RuntimeError(f"DeepEP v2: {problem}")


class Exchange(Protocol):
    """One DeepEP version's calls, in the shape this module needs."""

    max_tokens: int | None
    """Tokens per rank one dispatch may carry (None: any)."""

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

    def destroy(self) -> None:
        """Free the buffer now (collective over the group)."""
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


def chunk_count(most_tokens: int, max_tokens: int | None) -> int:
    """Dispatches a layer needs when the group's busiest rank has `most_tokens` tokens (pure)."""
    if max_tokens is None:
        return 1
    return max(1, math.ceil(most_tokens / max_tokens))


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
    """Free the cached exchanges of `group` (keys start with its id) now, on every rank in the same
    order (DeepEP's destroy is collective); a buffer that cannot be freed is logged, not raised:
    releasing runs while `auto` moves on to another backend."""
    for key in [k for k in cache if k[0] == id(group)]:
        exchange = cache.pop(key)
        try:
            exchange.destroy()
        except Exception as e:
            log.warning("DeepEP buffer %s could not be freed: %s: %s", key[1:], type(e).__name__, e)


class DeepEPDispatcher:
    """Expert parallelism through one DeepEP version (`exchange`); experts sharded in contiguous
    blocks like the all-to-all backends. Subclasses build the exchange lazily (DeepEP's constructors are
    collective and size their buffers by the row width of the first dispatch)."""

    name = "deepep"
    unavailable: str | None = None
    """Why this version cannot be built here (its `deep_ep` class did not import), or None."""

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, tokens: int | None = None) -> None:
        if self.unavailable:
            raise BackendUnavailable(f"{self.name} cannot serve here: {self.unavailable}")
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts do not divide over {self.world} ranks")
        self.num_experts = num_experts
        self.num_local = num_experts // self.world
        self.tokens = tokens  # tokens per rank per dispatch the buffers are sized for (None: default)
        self.bytes_sent = 0
        self.clock = ExchangeClock()

    def exchange(self, hidden: int, top_k: int) -> Exchange:
        raise NotImplementedError

    def release(self) -> None:
        """Free this group's DeepEP buffers (called on every rank when `auto` does not keep this one)."""

    def _chunks(self, tokens: int, max_tokens: int | None) -> int:
        """Dispatches for this layer, the same on every rank of the group (collective when capped)."""
        if max_tokens is None or self.world == 1:
            return chunk_count(tokens, max_tokens)
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        most = torch.tensor([tokens], dtype=torch.int64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        return chunk_count(int(most.item()), max_tokens)

    def _dispatch_chunk(self, exchange: Exchange, send, idx, weights, dtype) -> tuple:
        """One DeepEP dispatch → (rows by local expert, their weights, rows per expert, chunk handle)."""
        meta: dict[str, Any] = {}
        recv_x, recv_w = _Dispatch.apply(send, weights, idx, exchange, self.num_experts, meta, self.clock)
        recv_idx, counts = meta["recv_idx"], list(meta["counts"])  # (R, K) local ids; rows per expert
        order = local_expert_order(recv_idx, counts, self.num_local)
        token = order // recv_idx.shape[1]
        rows = recv_x.index_select(0, token).to(dtype)
        weights = recv_w.reshape(-1).index_select(0, order)
        return rows, weights, counts, (meta["handle"], token, recv_x.shape[0])

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        send = x.to(torch.bfloat16).contiguous()  # DeepEP moves bf16 rows
        exchange = self.exchange(send.shape[1], topk_idx.shape[1])
        n = self._chunks(send.shape[0], exchange.max_tokens)
        pieces = zip(
            send.tensor_split(n),
            topk_idx.to(torch.int64).tensor_split(n),
            topk_weights.float().tensor_split(n),
            strict=True,
        )
        dtype = row_dtype(x)
        parts = [self._dispatch_chunk(exchange, *(t.contiguous() for t in p), dtype) for p in pieces]
        self.bytes_sent += send.numel() * send.element_size()  # upper bound: local tokens counted too
        chunks = [p[3] for p in parts]
        if n == 1:
            rows, row_weights, counts, _ = parts[0]
            return Dispatched(rows, counts, row_weights, (exchange, chunks, None, None))
        # rows of all chunks, grouped by local expert (stable: chunk order within an expert)
        local = torch.arange(self.num_local)
        expert = torch.cat([torch.repeat_interleave(local, torch.tensor(p[2])) for p in parts])
        merge = torch.sort(expert.to(x.device), stable=True)[1]
        unmerge = torch.empty_like(merge)
        unmerge[merge] = torch.arange(merge.numel(), device=merge.device)
        rows = torch.cat([p[0] for p in parts]).index_select(0, merge)
        row_weights = torch.cat([p[1] for p in parts]).index_select(0, merge)
        counts = [sum(c) for c in zip(*(p[2] for p in parts), strict=True)]
        return Dispatched(rows, counts, row_weights, (exchange, chunks, unmerge, [sum(p[2]) for p in parts]))

    def combine(self, rows: torch.Tensor, handle: Any) -> torch.Tensor:
        exchange, chunks, unmerge, sizes = handle
        pieces = [rows] if unmerge is None else rows.index_select(0, unmerge).split(sizes)
        out = []
        for piece, (deepep_handle, token, num_recv) in zip(pieces, chunks, strict=True):
            partial = sum_per_token(piece, token, num_recv).to(torch.bfloat16)
            self.bytes_sent += partial.numel() * partial.element_size()
            out.append(_Combine.apply(partial, exchange, deepep_handle, self.clock))
        combined = out[0] if len(out) == 1 else torch.cat(out)
        return combined.to(rows.dtype)  # the layer casts to its input's dtype
