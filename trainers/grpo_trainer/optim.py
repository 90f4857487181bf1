"""AdamW for the trainer gang, by `trainer.sharding` (none | optimizer | full).

Built by the training loop (`grpo_trainer.loop.setup`). Parameters come in two families with
different replica groups (see `grpo_trainer.parallel`): dense ones are replicated over the whole
world, expert shards over the expert data-parallel group. Under `optimizer` each replicated
family's AdamW state (2x the weights in float32, the largest memory item of training) is split
over its replica group by `torch.distributed.optim.ZeroRedundancyOptimizer` (ZeRO-1): every rank
updates its part and broadcasts it. Under `full` the dense parameters are FSDP2 DTensors
(`grpo_trainer.fsdp`): plain AdamW over them keeps DTensor state, already split over the world;
experts are DTensors too when world > EP (split over expert-DP, so plain AdamW again), else
plain tensors with no replica to split over. Checkpoints write state under the
model's keys (`grpo_trainer.checkpoint.state`), whatever the partition. `trainer.optimizerOffload:
cpu` swaps AdamW for DeepSpeed's CPU Adam (`grpo_trainer.offload`) in every one of these cases:
the same partition, its state in host memory.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from grpo_trainer.parallel import Groups, split_parameters


def adamw_class(offload: str) -> type[torch.optim.Optimizer]:
    """torch's AdamW, or with `offload` "cpu" DeepSpeed's CPU Adam keeping the state in host
    memory (`grpo_trainer.offload`, imported only then: it JIT-builds a C++ op)."""
    if str(offload) == "cpu":
        from grpo_trainer.offload import CPUOffloadAdamW

        return CPUOffloadAdamW
    if str(offload) != "none":
        raise ValueError(f"optimizerOffload {offload!r}: expected none or cpu")
    return torch.optim.AdamW


def _adamw(
    params: list[nn.Parameter],
    group: dist.ProcessGroup | None,
    replicas: int,
    lr: float,
    zero: bool,
    cls: type[torch.optim.Optimizer],
) -> torch.optim.Optimizer | None:
    if not params:
        return None
    if zero and replicas > 1:
        return ZeroRedundancyOptimizer(params, cls, process_group=group, lr=lr, weight_decay=0.0)
    return cls(params, lr=lr, weight_decay=0.0)


class GangAdamW:
    """AdamW over both parameter families; the loop and checkpoints use it like one optimizer."""

    def __init__(
        self,
        model: nn.Module,
        groups: Groups,
        *,
        lr: float,
        sharding: str = "optimizer",
        offload: str = "none",
    ) -> None:
        """sharding: none | optimizer | full (`trainer.sharding`).
        offload: none | cpu (`trainer.optimizerOffload`: the state of whatever this rank updates
        lives in host memory, see `grpo_trainer.offload`)."""
        dense, experts = split_parameters(model)
        world = dist.get_world_size()
        expert_replicas = dist.get_world_size(groups.expert_dp) if groups.expert_dp is not None else 1
        zero = str(sharding) in ("optimizer", "full")
        fsdp_dense = any(isinstance(p, DTensor) for p in dense)  # already split: no ZeRO on top
        fsdp_experts = any(isinstance(p, DTensor) for p in experts)
        cls = adamw_class(offload)
        self.parts = {
            "dense": _adamw(dense, None, world, lr, zero and not fsdp_dense, cls),
            "experts": _adamw(experts, groups.expert_dp, expert_replicas, lr, zero and not fsdp_experts, cls),
        }

    def _each(self) -> list[tuple[str, torch.optim.Optimizer]]:
        return [(k, o) for k, o in self.parts.items() if o is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, opt in self._each():
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Collective under ZeRO: every rank of each replica group must call it."""
        for _, opt in self._each():
            opt.step()

    @staticmethod
    def _local(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer over this rank's own parameters (its ZeRO shard, or all of them)."""
        return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt

    def state_dict(self) -> dict[str, Any]:
        """This rank's part only: no gather, so saving costs no communication."""
        return {k: self._local(opt).state_dict() for k, opt in self._each()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, opt in self._each():
            self._local(opt).load_state_dict(state[k])

    def local_state_size(self) -> int:
        """Number of optimizer-state tensors held by this rank (what ZeRO shrinks)."""
        return sum(len(self._local(opt).state) for _, opt in self._each())
