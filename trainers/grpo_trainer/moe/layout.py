"""Where a rank's EP group sits (its ranks, nodes, device): what a backend's `requires` reads.

Pure apart from `layout_of`, which reads the live process group. Used by `auto` to offer only the
backends that can work on a layout, and by the DeepEP backends to choose v1 (inside one node) or v2
(across nodes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """Where this rank's EP group sits: its world ranks and how many ranks share a node."""

    ranks: tuple[int, ...]
    """World ranks of the EP group, in EP-rank order."""
    ranks_per_node: int
    """Ranks per pod/node (the contract's processesPerPod; ranks of a pod are consecutive)."""
    device: str
    """"cuda" (NCCL) or "cpu" (gloo)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> int:
        """Nodes the EP group spans."""
        return len({r // self.ranks_per_node for r in self.ranks})

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1


def layout_of(group: dist.ProcessGroup | None, ranks_per_node: int | None = None) -> Layout:
    """This rank's layout; ranks per node from the launcher's LOCAL_WORLD_SIZE by default."""
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    world = range(dist.get_world_size())
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(world)
    device = "cuda" if dist.get_backend(group) == "nccl" and torch.cuda.is_available() else "cpu"
    return Layout(ranks, max(1, ranks_per_node), device)


Requires = Callable[[Layout, int], str | None]
"""(layout, num_experts) → why a backend cannot work here, or None when it can."""
