"""Recording the MoE routing of an HF model while the torch engine samples (routing replay, R3).

Used by `grpo_rollout.engines.torch_engine` when a request has `return_routing`. Forward hooks on
the routers of the HF MoE blocks read the expert ids each block then dispatched on: every
supported router returns (logits, weights, indices), so the record is the block's own choice,
never a recomputation that could round differently. Layers are in module order, the order in
which the trainer's `grpo_trainer.moe.moe_layers` replays them.
"""

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from grpo_wire.protocol import Routing
from torch import nn

# The HF MoE blocks the trainer's `expert_parallel` converts (grpo_trainer.moe.hf.ARCHITECTURES).
MOE_BLOCKS = frozenset(
    {"Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "MixtralSparseMoeBlock", "DeepseekV3MoE"}
)


class RoutingRecorder:
    """Collects each MoE router's top-k ids; `take` returns one forward's as [tokens, layers, k]."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = [m.gate for m in model.modules() if type(m).__name__ in MOE_BLOCKS]
        if not self.routers:
            raise ValueError(
                f"return_routing needs an MoE model; {type(model).__name__} has none of {sorted(MOE_BLOCKS)}"
            )
        self.num_experts = max(int(r.num_experts) for r in self.routers)
        self._seen: list[torch.Tensor] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator["RoutingRecorder"]:
        """Hooks live only inside the block, so plain generates pay nothing."""
        self._seen.clear()
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._seen.clear()

    def _hook(self, _module: nn.Module, _args: object, output: tuple[torch.Tensor, ...]) -> None:
        self._seen.append(output[2].detach())  # (tokens, k) expert ids

    def take(self) -> torch.Tensor:
        """The latest forward's choices [tokens, layers, k] (int16 on the model's device)."""
        if len(self._seen) != len(self.routers):
            raise RuntimeError(f"{len(self._seen)} router calls recorded for {len(self.routers)} MoE layers")
        out = torch.stack(self._seen, dim=1).to(torch.int16)
        self._seen.clear()
        return out


def encode_routing(idx: torch.Tensor, num_experts: int) -> Routing:
    """[tokens, layers, k] expert ids → the wire form: uint8 when ids fit, else little-endian int16."""
    dtype = "uint8" if num_experts <= 256 else "int16"
    array = np.ascontiguousarray(idx.cpu().numpy(), dtype="u1" if dtype == "uint8" else "<i2")
    tokens, layers, k = array.shape
    return Routing.from_bytes(array.tobytes(), (tokens, layers, k), dtype)
