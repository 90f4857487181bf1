"""The `deepep` EP backend (`epBackend: deepep`): DeepEP v1 inside one node, v2 across nodes.

Never an `auto` candidate itself: `auto` measures the two versions as the backends they are. Asked
for by name, it fails naming the version, the library and what to change when that version cannot
serve the group (not installed, its import refused, no CUDA, a size it has no config for).
"""

from __future__ import annotations

import torch.distributed as dist

from grpo_trainer.moe.backends import deepep_v1, deepep_v2
from grpo_trainer.moe.deepep import DeepEPDispatcher
from grpo_trainer.moe.dispatch import BackendUnavailable, register_backend
from grpo_trainer.moe.layout import layout_of


@register_backend("deepep")
def deepep_dispatcher(
    group: dist.ProcessGroup | None, num_experts: int, tokens: int | None = None
) -> DeepEPDispatcher:
    group = group if group is not None else dist.group.WORLD
    layout = layout_of(group)
    version = deepep_v2 if layout.spans_nodes else deepep_v1
    why = version.requires(layout, num_experts)
    if why:
        where = f"across {layout.nodes} nodes" if layout.spans_nodes else "inside one node"
        raise BackendUnavailable(
            f"epBackend deepep: an EP group {where} needs {version.NAME} ({version.API}), which cannot "
            f"serve it here: {why}. Install DeepEP in the trainer image (docs/deepep-efa.md) or set "
            "spec.trainer.epBackend to auto or nccl"
        )
    return version.Dispatcher(group, num_experts, tokens)
