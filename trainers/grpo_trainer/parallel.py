"""torch.distributed plumbing of the trainer: process groups, the policy model, gradient sync.

Called by the training loop on every rank. Layout: world = data-parallel x expert-parallel;
EP groups are consecutive ranks (so an EP group stays inside a pod's NVLink island when
processesPerPod >= expertParallelSize). Every rank trains on its own sequences, so dense
parameters are averaged over the world; expert parameters, sharded over an EP group by
`grpo_trainer.moe.expert_parallel`, already hold the gradient of every token routed to them
within the EP group and are summed over the "expert data-parallel" group (same EP rank,
other EP groups). Gradients are summed, not averaged: the loss is normalised by the step's
global token/sequence totals (`grpo_trainer.losses.Totals`). `StopRequest` turns a signal
into a decision the whole gang takes at the same step.
"""

import datetime
import json
import logging
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from grpo_operator import storage
from grpo_operator.api.contract import RunContract
from grpo_operator.api.status import Reason
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from grpo_trainer import fsdp, loading, moe
from grpo_trainer.config import ConfigError, RankInfo

log = logging.getLogger(__name__)
PG_TIMEOUT = datetime.timedelta(minutes=30)  # a dead peer fails collectives instead of hanging forever


@dataclass(frozen=True)
class Groups:
    """The process groups this rank belongs to (None: the group would be just this rank)."""

    ep: dist.ProcessGroup | None
    expert_dp: dist.ProcessGroup | None
    own_ep: dist.ProcessGroup | None = None  # the EP group even at EP = 1, where it is just this rank


def init_distributed(info: RankInfo, contract: RunContract) -> torch.device:
    """Join the gang's default group (gloo on CPU, NCCL on GPU); return this rank's device."""
    backend = contract.trainer.backend
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{contract.trainer.master_addr}:{contract.trainer.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=PG_TIMEOUT,
    )
    return device


def group_device(backend: str, cuda_index: int) -> torch.device | None:
    """The device new groups are bound to: on NCCL this rank's GPU, so each group's communicator
    is created with the group (DeepEP v2 takes it through `_comm_ptr()`, which is 0 for a group
    torch creates lazily until its first collective); None for gloo (no device to bind)."""
    return torch.device("cuda", cuda_index) if backend == "nccl" else None


def make_groups(info: RankInfo) -> Groups:
    """EP groups of consecutive ranks and their transposes. Every rank creates every group, in
    the same order, as torch.distributed requires; on NCCL each with its communicator at once."""
    ep, dp = info.ep_size, info.world_size // info.ep_size
    backend = dist.get_backend()
    device = group_device(backend, torch.cuda.current_device() if backend == "nccl" else 0)
    ep_group = expert_dp_group = None
    for k in range(dp):
        g = dist.new_group(list(range(k * ep, (k + 1) * ep)), device_id=device)
        if info.rank // ep == k:
            ep_group = g
    for j in range(ep):
        g = dist.new_group(list(range(j, info.world_size, ep)), device_id=device)
        if info.ep_rank == j:
            expert_dp_group = g
    return Groups(
        ep=ep_group if ep > 1 else None, expert_dp=expert_dp_group if dp > 1 else None, own_ep=ep_group
    )


def ep_tokens_per_dispatch(
    micro_batch_size: int, max_tokens_per_micro_batch: int | None, max_new_tokens: int
) -> int:
    """Tokens one MoE layer dispatches at once on one rank: a micro-batch's (its token budget, or
    its sequences x the completion limit; prompts come on top and are not known at start-up).
    `auto` measures with it and DeepEP sizes its buffers for it; a layer that sees more tokens is
    dispatched in chunks (`grpo_trainer.moe.deepep`), so this need not be an upper bound."""
    return max_tokens_per_micro_batch or micro_batch_size * max_new_tokens


def check_ep_backend(backend: str, ep_size: int) -> None:
    """Refuse an `epBackend` that cannot serve this layout before any weights are read."""
    if backend == "deepep" and ep_size == 1:
        raise ValueError(
            "spec.trainer.epBackend deepep needs expert parallelism, but spec.trainer.expertParallelSize "
            "is 1 (no tokens leave a rank): set expertParallelSize above 1 or epBackend to auto"
        )


def load_policy(
    path: str,
    groups: Groups,
    backend: str,
    device: torch.device,
    *,
    cache_dir: str | None = None,
    sharding: str = "optimizer",
    activation_checkpointing: bool | None = None,
    ep_tokens: int | None = None,  # tokens per micro-batch per rank: `auto` measures with them
) -> nn.Module:
    """The HF model in float32 (optimizer master weights), expert-parallel when the EP group is
    larger than one rank, FSDP2-sharded when `sharding` is "full" (dense parameters over the world,
    experts over their expert data-parallel group). Reads a local
    directory (a PVC mount included) or an s3:// prefix, fetched once per pod into `cache_dir`
    (`grpo_operator.storage.model_dir`: the pod's ranks share one download); never the hub.

    Built on the meta device and filled from safetensors with only this rank's tensors
    (`grpo_trainer.loading`): its experts, its rows of FSDP-sharded tensors, replicated tensors whole.

    MoE blocks are `MoELayer`s at EP = 1 too (over this rank's one-rank group), since only those
    take given expert choices (routing replay) and the loader fills their experts.
    activation_checkpointing: per decoder layer; None means on under "full"."""
    check_ep_backend(backend, 1 if groups.ep is None else dist.get_world_size(groups.ep))
    local = storage.model_dir(path, cache_dir)
    model = loading.skeleton(local)
    if groups.ep is not None:
        try:
            moe.expert_parallel(model, group=groups.ep, backend=backend, tokens_per_batch=ep_tokens)
        except moe.BackendUnavailable as e:  # permanent: the job fails with it, no gang restarts
            raise ConfigError(str(e), reason=Reason.EP_BACKEND_UNAVAILABLE) from e
    else:  # MoELayers at EP = 1 too: replay needs them, and the loader fills their fused experts
        moe.expert_parallel(model, group=groups.own_ep, backend="local")
    full = str(sharding) == "full"
    if activation_checkpointing if activation_checkpointing is not None else full:
        for layer in fsdp.decoder_layers(model):
            fsdp.checkpoint_layer(layer)
    if full:
        experts = [layer.experts for layer in moe.moe_layers(model) if layer.experts.group is not None]
        fsdp.apply_fsdp(
            model,
            fsdp.world_mesh(device),
            experts=experts,
            experts_mesh=fsdp.expert_mesh(groups.expert_dp, device),
            bf16=device.type == "cuda",
        )
    loading.materialize(model, device)
    read = loading.fill(model, local)
    log.info("loaded %s: read %.1f MiB of safetensors on this rank", local, read / 2**20)
    return model.eval()  # as from_pretrained leaves it (no dropout)


def expert_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters sharded over the EP group."""
    return {
        id(p)
        for layer in moe.moe_layers(model)
        if layer.experts.group is not None
        for p in layer.experts.parameters()
    }


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(dense, expert) trainable parameters, each in a fixed order (identical on every rank)."""
    experts = expert_parameters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if id(p) not in experts], [p for p in params if id(p) in experts]


def _all_reduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum gradients over `group` as one flat buffer (one collective instead of one per tensor)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for p, g in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
        p.grad = g


def sync_gradients(model: nn.Module, groups: Groups) -> None:
    """Sum replicated gradients over their replicas: dense ones over the world, experts over
    expert-DP (FSDP2-sharded ones, DTensors, were already reduce-scattered by FSDP in backward)."""
    dense, experts = split_parameters(model)
    if dist.get_world_size() > 1:
        _all_reduce_grads([p for p in dense if not isinstance(p, DTensor)], None)
    if groups.expert_dp is not None:
        _all_reduce_grads([p for p in experts if not isinstance(p, DTensor)], groups.expert_dp)


def _sq(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    sq = torch.zeros((), device=device)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sq += g.float().pow(2).sum()
    return sq


def clip_gradients(model: nn.Module, groups: Groups, max_norm: float) -> float:
    """Clip by the global norm of the whole (unsharded) gradient; return that norm.

    Replicated dense gradients are identical on every rank after sync; FSDP2-sharded ones (dense
    row chunks over the world, experts split over EP and then expert-DP) are disjoint pieces of
    the whole, so their squared norms are summed over the world; plain expert shards differ
    across the EP group and are replicated over expert-DP, so theirs are summed over EP.
    """
    dense, experts = split_parameters(model)
    device = next(model.parameters()).device
    sharded = [p for p in dense + experts if isinstance(p, DTensor)]
    sq = _sq([p for p in dense if not isinstance(p, DTensor)], device)
    sharded_sq = _sq(sharded, device)
    expert_sq = _sq([p for p in experts if not isinstance(p, DTensor)], device)
    if sharded and dist.get_world_size() > 1:
        dist.all_reduce(sharded_sq)
    if groups.ep is not None:
        dist.all_reduce(expert_sq, group=groups.ep)
    norm = float((sq + sharded_sq + expert_sq).sqrt())
    if norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in dense + experts:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


class StopRequest:
    """SIGTERM/SIGINT (pod deletion, suspend, preemption, Ctrl-C): finish the step, save, stop.

    Signals reach ranks at different moments, so the gang agrees through a one-element MAX
    all-reduce after every step; then every rank saves the same step and exits together.
    """

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        log.warning("received %s: stopping after this step with a checkpoint", signal.Signals(signum).name)
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def broadcast_bytes(data: bytes | None, device: torch.device, src: int = 0) -> bytes:
    """`data` of rank `src` on every rank, as raw bytes. Unlike broadcast_object_list nothing
    received is unpickled: whoever reaches the gang's ports can send data, never code."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if int(size) == 0:
        return b""
    if dist.get_rank() == src:
        assert data is not None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src)
    return buf.cpu().numpy().tobytes()


def broadcast_json(obj: object, device: torch.device, src: int = 0) -> object:
    """A JSON value of rank `src` on every rank (other ranks pass anything, e.g. None)."""
    mine = json.dumps(obj).encode() if dist.get_rank() == src else None
    return json.loads(broadcast_bytes(mine, device, src))
