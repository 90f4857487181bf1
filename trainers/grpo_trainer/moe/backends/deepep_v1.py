"""DeepEP v1 (`deep_ep.Buffer`, normal mode) for EP groups inside one NVLink node.

The backend `deepep_v1`, always registered and an `auto` candidate; where `deep_ep.Buffer` does not
import, `requires` refuses it with the import's reason and building it by name raises
BackendUnavailable. Never for a group that spans nodes: v1's internode kernels need InfiniBand
IBGDA (with more than one RDMA rank `Buffer.__init__` forces `NVSHMEM_IB_ENABLE_IBGDA=1`), which
EFA lacks; `requires` refuses
such a group with that reason. The sizes it supports are probed from the installed library (its
config getters raise for a size they have no config for), not copied into a table. v1's normal
mode pipelines any token count through its buffer, so it needs no token cap.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from grpo_wire.deepep_import import import_deep_ep

from grpo_trainer.moe import collective_build
from grpo_trainer.moe.deepep import DeepEPDispatcher, release_exchanges
from grpo_trainer.moe.dispatch import register_backend
from grpo_trainer.moe.layout import Layout

NAME = "deepep_v1"
API = "deep_ep.Buffer"
Buffer, WHY = import_deep_ep("Buffer")  # None and the reason on CPU images or a v2-only build
AVAILABLE = Buffer is not None


def requires(layout: Layout, num_experts: int, buffer_cls: Any = None) -> str | None:
    """Why v1 cannot serve this layout, or None (pure apart from the library's config getters)."""
    buffer_cls = buffer_cls or Buffer
    if buffer_cls is None:
        return WHY or "deep_ep.Buffer is not installed"
    if layout.device != "cuda":
        return "DeepEP needs CUDA GPUs"
    if layout.spans_nodes:
        return (
            f"the EP group spans {layout.nodes} nodes: DeepEP v1's internode kernels need InfiniBand "
            "IBGDA, which EFA lacks (DeepEP v2 or nccl all-to-all serve groups across nodes)"
        )
    if num_experts % layout.size:
        return f"{num_experts} experts do not divide over {layout.size} ranks"
    try:  # the installed version's own map of supported sizes
        buffer_cls.get_dispatch_config(layout.size)
        buffer_cls.get_combine_config(layout.size)
    except Exception as e:
        return f"this DeepEP v1 has no config for EP {layout.size} ({type(e).__name__}: {e})"
    return None


class V1Exchange:
    """One `Buffer` per (group, row width), NVLink only (no RDMA bytes), sized by DeepEP's hints;
    freed by `destroy` (collective), not by the garbage collector at some rank-dependent moment."""

    max_tokens = None  # normal mode pipelines any count

    def __init__(self, group: dist.ProcessGroup, hidden_bytes: int) -> None:
        size = group.size()
        nvl_bytes = max(
            config.get_nvl_buffer_size_hint(hidden_bytes, size)
            for config in (Buffer.get_dispatch_config(size), Buffer.get_combine_config(size))
        )
        self.buffer = Buffer(group, nvl_bytes, 0, explicitly_destroy=True)

    def dispatch(self, x, topk_idx, topk_weights, num_experts):  # see deepep.Exchange
        layout = self.buffer.get_dispatch_layout(topk_idx, num_experts)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = layout
        recv_x, recv_idx, recv_weights, counts, handle, _ = self.buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        return recv_x, recv_idx, recv_weights, counts, handle

    def redispatch(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.buffer.dispatch(x, handle=handle)[0]

    def combine(self, x, handle, topk_weights=None):
        combined, weights, _ = self.buffer.combine(x, handle, topk_weights=topk_weights)
        return combined, weights

    def destroy(self) -> None:
        self.buffer.destroy()


_EXCHANGES: dict[tuple[int, int], V1Exchange] = {}


@register_backend(NAME, requires=requires)
class Dispatcher(DeepEPDispatcher):
    """DeepEP v1 inside one node."""

    name = NAME
    unavailable = None if AVAILABLE else f"{API} does not import: {WHY}"

    def exchange(self, hidden: int, top_k: int) -> V1Exchange:
        key = (id(self.group), hidden * torch.bfloat16.itemsize)
        if key not in _EXCHANGES:
            build = partial(V1Exchange, self.group, key[1])
            _EXCHANGES[key] = collective_build.build(
                "DeepEP v1's Buffer", self.group, build
            )  # bounded, agreed
        return _EXCHANGES[key]

    def release(self) -> None:
        release_exchanges(_EXCHANGES, self.group)
