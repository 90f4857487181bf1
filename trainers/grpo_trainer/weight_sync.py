"""Streaming weight sync, the trainer's side: every rank sends what it owns, bucket by bucket.

Called by `grpo_trainer.pusher.WeightPusher` when the transport is `collective`
(spec.rollout.weightSync). Nothing is gathered: a tensor's elements are sent by the ranks that
hold them, each element by exactly one rank:
- an FSDP2 DTensor sharded in rows (Shard(0)): each rank sends its own rows;
- a routed-experts tensor split by EP: the rank's block of experts, at its EP rank's offset in
  the full (E, ...) tensor (its FSDP rows within that block when experts are sharded further);
- a tensor replicated over R ranks (plain dense weights, experts over their expert-DP group):
  each of the R ranks sends one R-th of its elements.
A tied `lm_head.weight` (the same parameter as the input embedding) is sent once, under the
embedding's name. The bytes travel through `grpo_rollout.weight_stream` (one group per rank, the
servers in every group) and the rollout servers reassemble HF-named tensors; rank 0 tells them,
over HTTP, where to connect and which tensors to expect (`Generator.stream`).
"""

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from grpo_operator.api.contract import RunContract
from grpo_rollout import weight_stream
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from grpo_trainer import moe

log = logging.getLogger(__name__)
Item = tuple[str, int, torch.Tensor]  # (HF name, first element in the flattened full tensor, 1-D values)


def tied_aliases(model: nn.Module) -> set[str]:
    """Parameter names that repeat an earlier name's parameter (a tied `lm_head.weight`)."""
    seen: set[int] = set()
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def expert_groups(model: nn.Module) -> dict[str, dist.ProcessGroup]:
    """The EP group of each routed-experts tensor split over more than one rank."""
    out = {}
    for name, layer in model.named_modules():
        group = layer.experts.group if isinstance(layer, moe.MoELayer) else None
        if group is not None and dist.get_world_size(group) > 1:
            out[f"{name}.experts.gate_up_proj"] = out[f"{name}.experts.down_proj"] = group
    return out


def full_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Every tensor the servers get, with its full (HF) shape; no collective, no copy."""
    experts = expert_groups(model)
    shapes, aliases = {}, tied_aliases(model)
    for name, t in model.state_dict().items():
        if name in aliases:
            continue
        shape = list(t.shape)  # a DTensor's shape is its global one
        if name in experts:
            shape[0] *= dist.get_world_size(experts[name])
        shapes[name] = shape
    return shapes


def share(numel: int, index: int, count: int) -> tuple[int, int]:
    """[lo, hi) of the `index`-th of `count` near-equal parts of `numel` elements."""
    per = -(-numel // count) if count else numel
    lo = min(index * per, numel)
    return lo, min(lo + per, numel)


def _local_part(t: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int, int, int]:
    """(values this rank holds, their first element in `t`'s global flattening, index among the
    ranks holding the same values, how many such ranks)."""
    if not isinstance(t, DTensor):
        return t, 0, rank, world
    mesh, placements = t.device_mesh, t.placements
    if mesh.ndim != 1:
        raise ValueError(f"weight sync: {mesh.ndim}-D meshes are not supported")
    if isinstance(placements[0], Replicate):
        return t.to_local(), 0, mesh.get_local_rank(), mesh.size()
    if not (isinstance(placements[0], Shard) and placements[0].dim == 0):
        raise ValueError(f"weight sync: placement {placements} is not supported (Shard(0) or Replicate)")
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    return t.to_local(), offset[0] * math.prod(t.shape[1:]), 0, 1


def owned_items(model: nn.Module, rank: int, world: int, ep_size: int) -> Iterator[Item]:
    """This rank's share of every tensor (see the module doc): views, never copies or gathers."""
    experts = expert_groups(model)
    aliases = tied_aliases(model)
    for name, t in model.state_dict().items():
        if name in aliases:
            continue
        group = experts.get(name)
        if group is None:
            values, start, index, count = _local_part(t, rank, world)
        else:  # experts: the EP block at its offset, then as a DTensor (efsdp) or replicated over expert-DP
            values, start, index, count = _local_part(t, rank // ep_size, world // ep_size)
            start += dist.get_rank(group) * math.prod(t.shape)
        flat = values.detach().reshape(-1)
        lo, hi = share(flat.numel(), index, count)
        if hi > lo:
            yield name, start + lo, flat[lo:hi]


@dataclass
class SendStats:
    buckets: int
    sent_bytes: int
    peak_bytes: int  # the most this rank's sender held at once (buffers), see BucketSender
    waited_s: float = 0.0  # time spent waiting for the wire to free a buffer
    filled_s: float = 0.0  # time spent converting into buckets


class StreamSender:
    """One trainer rank's end of the weight groups: the store (rank 0 hosts it) and the rank's
    group with the servers of the current epoch, formed again when the epoch changes. Its two
    bucket buffers are kept from one version to the next (the trainer's memory plan counts them
    for the whole step), so a version does not pay for fresh memory, and across a stream that
    broke: its retired group's transfers may still read them (gloo cannot abort a transfer, and
    one whose peer died mid-send can stay pending until the op timeout), but only towards members
    that gave that stream up, while a fresh pair of buffers would make the retry hold four."""

    def __init__(self, host: str, port: int, rank: int, *, timeout_s: float = 300.0) -> None:
        import datetime

        self.rank, self.timeout_s = rank, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self.store = dist.TCPStore(
                host, port, is_master=rank == 0, timeout=timeout, wait_for_workers=False
            )
        except dist.DistNetworkError as e:
            if rank != 0 or "EADDRINUSE" not in str(e):
                raise
            # taken meanwhile (the local runtime picks free ports before the processes start): any
            # port will do, the servers and the other ranks are told which (`port`)
            log.warning("weight-sync port %d is in use; hosting the store on a free port instead", port)
            self.store = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        self.port = self.store.port
        self._watch = weight_stream.store_client(host, self.port, timeout_s)  # a client for call-offs
        self._key: tuple | None = None
        self._group: weight_stream.Group | None = None
        self._kept: tuple[tuple, list[torch.Tensor]] = ((), [])  # (bucket bytes, device), buffers

    def group(
        self, epoch: int, servers: int, backend: str, off: weight_stream.CallOff | None = None
    ) -> weight_stream.Group:
        """This rank's group of `epoch` (rank 0 in it, the servers 1..); blocks until they join."""
        key = (epoch, servers, backend)
        if key != self._key or self._group is None:
            weight_stream.retire(self._group)
            self._key, self._group = None, None
            prefixed = dist.PrefixStore(f"{weight_stream.STORE_PREFIX}/{epoch}/{self.rank}", self.store)
            self._group = weight_stream.form_group(prefixed, 0, 1 + servers, backend, self.timeout_s, off)
            self._key = key
        return self._group

    def call_off(self, epoch: int) -> None:
        """Stop every member waiting on `epoch`'s stream (any thread)."""
        weight_stream.CallOff(self._watch, epoch).call()

    def send(
        self,
        items: Iterator[Item],
        *,
        epoch: int,
        servers: int,
        backend: str,
        dtype: torch.dtype,
        bucket_bytes: int,
        device: torch.device,
    ) -> SendStats:
        """Form (or reuse) the epoch's group and stream `items`. A failure here calls the stream off
        for every member; a call-off by another member ends this rank's part (StreamCancelled)."""
        off = weight_stream.CallOff(self._watch, epoch)
        fits = (bucket_bytes, torch.device(device))
        kept = self._kept[1] if self._kept[0] == fits else []
        self._kept = ((), [])  # a different bucket size or device frees the old buffers first
        sender: weight_stream.BucketSender | None = None
        try:
            sender = weight_stream.BucketSender(
                self.group(epoch, servers, backend, off), dtype, bucket_bytes, device, off, kept
            )
            sender.send(items)
        except Exception as e:
            if not isinstance(e, weight_stream.StreamCancelled):
                off.call()
            weight_stream.retire(self._group)  # before any other reference to it goes
            self._key, self._group = None, None  # a broken group is formed again next time
            self._kept = (fits, sender.keep() if sender is not None else kept)  # see the class docstring
            raise
        stats = SendStats(
            sender.buckets, sender.sent_bytes, sender.peak_bytes, sender.waited_s, sender.filled_s
        )
        self._kept = (fits, sender.keep())
        return stats


def transport(contract: RunContract) -> str:
    """`collective` or `http` (spec.rollout.weightSync, see `RolloutSpec.streams_weights`). A
    contract without a weight-sync port (rendered for tests without one) takes HTTP under auto."""
    rollout, port = contract.spec.rollout, contract.trainer.weight_sync_port
    if not rollout.streams_weights:
        return "http"
    if port is None:
        if str(rollout.weight_sync.transport) == "collective":
            raise ValueError(
                "spec.rollout.weightSync.transport collective: the contract has no weightSyncPort"
            )
        return "http"
    return "collective"
