"""SwiGLU experts of one rank, run as a grouped GEMM over rows already sorted by expert.

Called by `grpo_trainer.moe.layer.MoELayer` between dispatch and combine. Rows arrive grouped
by local expert with a count per expert, so every expert is one contiguous segment and no
per-expert gather, mask or padding is needed. On CUDA with bf16 the segments go to
`torch._grouped_mm`, one kernel per projection. Elsewhere a hand-written autograd function
calls one BLAS `mm` per non-empty segment into preallocated buffers and runs the elementwise
SwiGLU once over all rows: autograd never sees the per-expert slices (whose backward would
allocate a full-size zero tensor per expert), which is what makes fine-grained and skewed
routing cheap on the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def _segments(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, start, stop) of every non-empty segment."""
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append((e, start, start + c))
        start += c
    return out


def _empty_grad(weight: torch.Tensor, segs: list[tuple[int, int, int]]) -> torch.Tensor:
    """Gradient buffer for per-expert weights: zeros only where an expert got no rows."""
    grad = torch.empty_like(weight)
    busy = {e for e, _, _ in segs}
    for e in range(weight.shape[0]):
        if e not in busy:
            grad[e].zero_()
    return grad


class _SegmentSwiGLU(torch.autograd.Function):
    """y[s] = w[s] * down[e] · (silu(gate[e] · x[s]) * (up[e] · x[s])) for each expert segment s.

    The routing weight w is applied on the narrower side: to the down projection's input
    (width I) for fine-grained experts, to its output (width H) for wide ones. Elementwise work
    is a handful of full-width passes (fused `silu_backward`, in-place products into
    preallocated halves): on a CPU those passes cost about as much as the GEMMs.
    """

    @staticmethod
    def forward(ctx, x, weights, gate_up, down, counts):  # type: ignore[override]
        segs = _segments(counts)
        inter, hidden = down.shape[-1], down.shape[1]
        h = x.new_empty(x.shape[0], 2 * inter)  # (N, 2I): gate | up
        for e, a, b in segs:
            torch.mm(x[a:b], gate_up[e].t(), out=h[a:b])
        silu = F.silu(h[:, :inter])  # (N, I)
        act = silu * h[:, inter:]
        ctx.weight_output = inter > hidden
        down_input = act if ctx.weight_output else act * weights.unsqueeze(1)
        y = x.new_empty(x.shape[0], hidden)  # (N, H)
        for e, a, b in segs:
            torch.mm(down_input[a:b], down[e].t(), out=y[a:b])
        ctx.segs = segs
        if ctx.weight_output:
            ctx.save_for_backward(x, weights, gate_up, down, h, silu, act, y)
            return y * weights.unsqueeze(1)
        ctx.save_for_backward(x, weights, gate_up, down, h, silu, act)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weights, gate_up, down, h, silu, act, *y = ctx.saved_tensors
        segs, inter = ctx.segs, down.shape[-1]
        dy = dy.contiguous()
        d_act = x.new_empty(x.shape[0], inter)  # (N, I)
        d_down = _empty_grad(down, segs)
        if ctx.weight_output:
            d_weights = torch.linalg.vecdot(dy, y[0])  # (N,)
            dy = dy * weights.unsqueeze(1)
            for e, a, b in segs:
                torch.mm(dy[a:b], down[e], out=d_act[a:b])
        else:
            for e, a, b in segs:
                torch.mm(dy[a:b], down[e], out=d_act[a:b])
            d_weights = torch.linalg.vecdot(d_act, act)  # (N,)
            d_act.mul_(weights.unsqueeze(1))
            act.mul_(weights.unsqueeze(1))  # the forward's down input, rebuilt in place for d_down
        for e, a, b in segs:
            torch.mm(dy[a:b].t(), act[a:b], out=d_down[e])
        dh = torch.empty_like(h)  # (N, 2I): d gate | d up
        torch.mul(d_act, silu, out=dh[:, inter:])
        d_act.mul_(h[:, inter:])
        torch.ops.aten.silu_backward.grad_input(d_act, h[:, :inter], grad_input=dh[:, :inter])
        dx = torch.empty_like(x)
        d_gate_up = _empty_grad(gate_up, segs)
        for e, a, b in segs:
            torch.mm(dh[a:b].t(), x[a:b], out=d_gate_up[e])
            torch.mm(dh[a:b], gate_up[e], out=dx[a:b])
        return dx, d_weights, d_gate_up, d_down, None


def _grouped_mm_swiglu(x, weights, gate_up, down, counts: list[int]) -> torch.Tensor:
    """The same computation with `torch._grouped_mm` (CUDA, bf16); autograd is built in."""
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs)
    inter = down.shape[-1]
    act = F.silu(h[:, :inter]) * h[:, inter:] * weights.unsqueeze(1).to(h.dtype)
    return torch._grouped_mm(act, down.transpose(1, 2), offs=offs)


def grouped_swiglu(
    x: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Rows x (N, H) grouped by expert (counts[e] rows each), routing weights (N,) → outputs (N, H).

    gate_up (E, 2I, H) and down (E, H, I) have the Hugging Face fused-expert layout.
    """
    if sum(counts) != x.shape[0]:
        raise ValueError(f"counts sum to {sum(counts)} but x has {x.shape[0]} rows")
    if x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] > 0:
        return _grouped_mm_swiglu(x, weights, gate_up, down, counts)
    return _SegmentSwiGLU.apply(x, weights.to(x.dtype), gate_up, down, counts)


class GroupedExperts(nn.Module):
    """The local experts of one MoE block, with HF parameter names and layouts.

    `gate_up_proj` (E_local, 2I, H) holds gate rows then up rows; `down_proj` (E_local, H, I).
    `first_expert` is the global id of local expert 0 and `group` the EP group the experts are
    sharded over (None for EP = 1); checkpoint loading and gathering use both. Under
    `trainer.sharding: full` with world > EP the two parameters become FSDP2 DTensors split in
    whole experts (Shard(0)) over the expert data-parallel group (`grpo_trainer.fsdp`): `held`
    says which experts this rank then stores.
    """

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        num_experts: int,
        first_expert: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        if gate_up_proj.shape[0] != down_proj.shape[0] or gate_up_proj.shape[1] != 2 * down_proj.shape[2]:
            raise ValueError(f"inconsistent expert shapes {gate_up_proj.shape} / {down_proj.shape}")
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.group = group

    @property
    def num_local_experts(self) -> int:
        """Experts of this rank's EP block (whether or not FSDP splits them further)."""
        return self.gate_up_proj.shape[0]

    def held(self) -> tuple[int, int]:
        """(global id of the first expert this rank stores, how many): its EP block, or its
        Shard(0) chunk of that block under FSDP (possibly empty when the block has fewer experts
        than the expert data-parallel group has ranks)."""
        w = self.gate_up_proj
        if not isinstance(w, DTensor):
            return self.first_expert, w.shape[0]
        shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
        if tuple(shape[1:]) != tuple(w.shape[1:]):
            raise NotImplementedError(f"experts are split in whole experts only, got {w.placements}")
        return self.first_expert + offset[0], shape[0]

    def forward(self, rows: torch.Tensor, counts: list[int], weights: torch.Tensor) -> torch.Tensor:
        """Rows grouped by local expert and their routing weights → weighted expert outputs, in the
        rows' dtype: fp32 master weights are cast to it (autograd returns fp32 gradients)."""
        dtype = rows.dtype  # the compute dtype: bf16 rows under autocast or FSDP2 mixed precision
        return grouped_swiglu(rows, weights, self.gate_up_proj.to(dtype), self.down_proj.to(dtype), counts)
