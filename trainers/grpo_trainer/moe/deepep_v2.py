"""DeepEP v2 (`deep_ep.ElasticBuffer`, "EPv2") for EP groups across EFA nodes, over NCCL GIN.

Registered as `deepep_v2` (and an `auto` candidate) by `grpo_trainer.moe.deepep` only when
`deep_ep.ElasticBuffer` imports. Offered for groups that span nodes (inside one node v1 and
`alltoall` serve). Run-time needs (see docs/deepep-efa.md): NCCL >= 2.31 with GIN, aws-ofi-nccl
>= 1.21 as the NCCL net and GIN plugin, GDRCopy's `gdrdrv`, and the pod env the renderer sets
(`NCCL_GIN_TYPE`, never IBGDA/GDAKI). Written against the upstream v2 API, not yet run here.

Settings (pod env, the same on every rank):
- GRPO_DEEPEP_MAX_TOKENS: `num_max_tokens_per_rank` (default 16384): sizes the buffer; every
  rank passes the same value, and a dispatch of more tokens is refused with this name in the error.
- GRPO_DEEPEP_NUM_SMS / GRPO_DEEPEP_NUM_QPS: SMs and QPs per dispatch/combine. v2 sizes them
  itself by parsing `ibstat` for mlx5 NICs, which EFA does not have, so on EFA (FI_PROVIDER=efa)
  they are always passed: 12 SMs (the AWS launcher's value) and v2's own QP estimate for them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from grpo_trainer.moe import autoselect
from grpo_trainer.moe.deepep import DeepEPDispatcher, deepep_dispatcher, release_exchanges
from grpo_trainer.moe.dispatch import register_backend

NAME = "deepep_v2"
MAX_LOCAL_EXPERTS = 256  # upstream's documented bound on experts per rank
try:
    from deep_ep import ElasticBuffer
except ImportError as e:  # CPU images, or a v1-only build
    ElasticBuffer, WHY = None, f"deep_ep.ElasticBuffer does not import ({e})"
else:
    WHY = ""
AVAILABLE = ElasticBuffer is not None


def requires(layout: autoselect.Layout, num_experts: int, buffer_cls: Any = None) -> str | None:
    """Why v2 should not serve this layout, or None."""
    if (buffer_cls or ElasticBuffer) is None:
        return WHY or "deep_ep.ElasticBuffer is not installed"
    if layout.device != "cuda":
        return "DeepEP needs CUDA GPUs"
    if not layout.spans_nodes:
        return "the EP group is inside one node: DeepEP v1 or alltoall serve it"
    if num_experts % layout.size:
        return f"{num_experts} experts do not divide over {layout.size} ranks"
    if num_experts // layout.size > MAX_LOCAL_EXPERTS:
        return f"{num_experts // layout.size} experts per rank; DeepEP v2 takes at most {MAX_LOCAL_EXPERTS}"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
        return "DeepEP v2 needs SM90 or newer"
    return None


def settings(env: dict[str, str] | None = None) -> tuple[int, int | None, int | None]:
    """(max tokens per rank, SMs or None for v2's choice, QPs or None for v2's estimate)."""
    env = dict(os.environ) if env is None else env
    max_tokens = int(env.get("GRPO_DEEPEP_MAX_TOKENS", "16384"))
    efa = env.get("FI_PROVIDER") == "efa"
    sms = env.get("GRPO_DEEPEP_NUM_SMS", "12" if efa else "")
    qps = env.get("GRPO_DEEPEP_NUM_QPS", "")
    return max_tokens, int(sms) if sms else None, int(qps) if qps else None


class V2Exchange:
    """One `ElasticBuffer` per (group, hidden, top-k), sized by v2 from the MoE settings."""

    def __init__(self, group: dist.ProcessGroup, hidden: int, top_k: int) -> None:
        self.max_tokens, sms, qps = settings()
        self.buffer = ElasticBuffer(
            group, num_max_tokens_per_rank=self.max_tokens, hidden=hidden, num_topk=top_k
        )
        self.num_sms = sms or 0  # 0: v2 decides (only off EFA, see the module docstring)
        self.num_qps = qps or (self.buffer.get_theoretical_num_qps(sms) if sms else 0)

    def dispatch(self, x, topk_idx, topk_weights, num_experts):  # see deepep.Exchange
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens on this rank > GRPO_DEEPEP_MAX_TOKENS={self.max_tokens}")
        recv_x, recv_idx, recv_weights, handle, _ = self.buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_experts=num_experts,
            num_max_tokens_per_rank=self.max_tokens,
            num_sms=self.num_sms,
            num_qps=self.num_qps,
            do_cpu_sync=True,  # exact receive counts: the one host sync the exchange needs
        )
        return recv_x, recv_idx, recv_weights, handle.num_recv_tokens_per_expert_list, handle

    def redispatch(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.buffer.dispatch(x, handle=handle, num_sms=self.num_sms, num_qps=self.num_qps)[0]

    def combine(self, x, handle, topk_weights=None):
        combined, weights, _ = self.buffer.combine(
            x, handle, topk_weights=topk_weights, num_sms=self.num_sms, num_qps=self.num_qps
        )
        return combined, weights


_EXCHANGES: dict[tuple[int, int, int], V2Exchange] = {}


class Dispatcher(DeepEPDispatcher):
    """DeepEP v2 across nodes."""

    name = NAME

    def exchange(self, hidden: int, top_k: int) -> V2Exchange:
        key = (id(self.group), hidden, top_k)
        if key not in _EXCHANGES:
            _EXCHANGES[key] = V2Exchange(self.group, hidden, top_k)
        return _EXCHANGES[key]

    def release(self) -> None:
        release_exchanges(_EXCHANGES, self.group)


if AVAILABLE:
    register_backend(NAME)(Dispatcher)
    register_backend("deepep")(deepep_dispatcher)  # v1 inside a node, v2 across nodes
    autoselect.register_candidate(NAME, requires)
