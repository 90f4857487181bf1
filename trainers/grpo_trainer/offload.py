"""`trainer.optimizerOffload: cpu`: AdamW whose state lives in host memory, stepped by DeepSpeed.

Built by `grpo_trainer.optim.GangAdamW` in place of `torch.optim.AdamW` (and as ZeRO-1's inner
optimizer under `sharding: optimizer`), over the parameters this rank updates: FSDP2 shards
(DTensors: their local chunk), ZeRO-1 partitions or whole tensors. AdamW's two fp32 moments,
8 bytes per parameter and the largest item of a GPU's training memory, stay in (pinned) host
memory, and so does an fp32 copy of the parameter that DeepSpeed's vectorised C++ Adam
(`DeepSpeedCPUAdam`'s `cpu_adam` op, JIT-built with ninja and a C++ compiler into
TORCH_EXTENSIONS_DIR on first use) updates in place; each step copies the gradient to the host
and the updated values back. On a CPU rank the parameter itself is that copy.

The state keeps `torch.optim.AdamW`'s form (a float32 `step` tensor, `exp_avg`, `exp_avg_sq`,
DTensors for DTensor parameters), so checkpoints (`grpo_trainer.checkpoint.state`) read and write
it unchanged and a save taken with offload resumes without it, and back.
"""

from typing import Any

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _host_zeros(like: torch.Tensor) -> torch.Tensor:
    """fp32 zeros shaped like `like` in host memory, pinned when `like` lives on a GPU (fast copies)."""
    return torch.zeros(like.shape, dtype=torch.float32, device="cpu", pin_memory=like.is_cuda)


class CPUOffloadAdamW(DeepSpeedCPUAdam):
    """DeepSpeed's CPU AdamW for parameters on any device, its state in host memory."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True)
        self._masters: dict[torch.Tensor, torch.Tensor] = {}  # parameter → the fp32 host copy stepped

    def fresh_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero AdamW state for `p` in host memory (what a resume loads into)."""
        local = _local(p)

        def wrap(t: torch.Tensor) -> torch.Tensor:
            # a DTensor like p's (same mesh, placements, global shape) over a host chunk; from_local
            # would move the chunk to the mesh's device, which is what offloading avoids
            return DTensor(t, p._spec, requires_grad=False) if isinstance(p, DTensor) else t

        step = torch.tensor(0.0, dtype=torch.float32)
        return {"step": step, "exp_avg": wrap(_host_zeros(local)), "exp_avg_sq": wrap(_host_zeros(local))}

    def _master(self, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The fp32 host tensor the op updates: the parameter itself when it is one, else a copy
        taken at the parameter's first step (after any resume)."""
        if local.device.type == "cpu" and local.dtype == torch.float32 and local.is_contiguous():
            return local
        if p not in self._masters:
            self._masters[p] = _host_zeros(local).copy_(local)
        return self._masters[p]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self.fresh_state(p))
                state["step"] += 1
                local = _local(p)
                if local.numel() == 0:  # an FSDP2 rank past the end of a short tensor
                    continue
                master = self._master(p, local)
                grad = _local(p.grad).to("cpu", torch.float32).contiguous()
                self.ds_opt_adam.adam_update(
                    self.opt_id, int(state["step"]), group["lr"], beta1, beta2, group["eps"],
                    group["weight_decay"], group["bias_correction"], master, grad,
                    _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                )  # fmt: skip
                if master is not local:
                    local.copy_(master)
        return loss
