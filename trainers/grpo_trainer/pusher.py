"""The trainer's side of weight sync, one object per rank: `WeightPusher`.

It owns the transport choice (spec.rollout.weightSync, `weight_sync.transport`) and both paths:
- `collective`: every rank converts the weights it holds, chunk by chunk, into the rollout dtype;
  the ranks exchange the chunks so that each feeder forwards whole buckets to the servers' workers
  it feeds, one group per worker whatever the trainer's size (`grpo_trainer.weight_sync.StreamSender`);
  rank 0 tells the servers where to join over HTTP (`Generator.stream`). Nothing is kept.
- `http`: rank 0's EP group gathers the unsharded weights one tensor at a time and rank 0 POSTs
  them as safetensors buckets (`Generator.push`), keeping them for servers that come up later.

Failures, in one place:
- a server lost mid-stream breaks the groups for every member, so none may take the version: the
  ranks agree to stream it again, in new groups of the servers still up, and fail (WeightSyncError,
  a gang restart) only when a server that is up keeps refusing it;
- no server ready at all (every one replaced, its engine dead, its node gone) is not a failure of
  the version: it goes to each replacement as it comes up, behind the live weights — over HTTP by
  the generator's repair, over the collective transport by `catch_up`, which every rank joins while
  rank 0 waits for generation (`grpo_trainer.loop.receive_rollouts`).
"""

import logging
import time
from collections.abc import Iterator

import torch
from grpo_operator.api.contract import RunContract
from grpo_wire import weight_stream
from grpo_wire.holdings import Holding
from torch import nn
from torch.distributed.tensor import DTensor

from grpo_trainer import moe, weight_sync
from grpo_trainer.config import RankInfo
from grpo_trainer.generation import Generator, WeightSyncError
from grpo_trainer.parallel import broadcast_json

log = logging.getLogger(__name__)
PUSH_TIMEOUT_S = 300.0  # per collective operation of a weight stream (a vanished server fails it)
STREAM_ATTEMPTS, STREAM_RETRY_S = 3, 2.0  # a stream no server took is sent again, to the servers still up


def check_holdings(plan: dict, shapes: dict[str, list[int]], experts: list[str]) -> None:
    """A ValueError naming the rollout server whose members declare experts the model does not have
    (a misconfigured server: no stream could make it whole, so the job fails rather than retrying)."""
    counts = {shapes[name][0] for name in experts}
    for cls, held in enumerate(plan.get("holdings", [])):
        bad = sorted(e for e in held or [] if any(not 0 <= e < n for n in counts))
        if bad:
            member = plan["classes"].index(cls)
            server = max(i for i, first in enumerate(plan["first"]) if first <= member)
            raise ValueError(
                f"rollout server {plan['servers'][server]} (member {member}) holds routed experts {bad[:5]}, "
                f"which a model of {sorted(counts)} experts per layer does not have"
            )


class WeightPusher:
    """Sends the policy's weights to the rollout servers as numbered versions. Every method is
    collective (all ranks call it, in the same order); `generator` is rank 0's, None elsewhere."""

    def __init__(
        self,
        contract: RunContract,
        info: RankInfo,
        model: nn.Module,
        device: torch.device,
        generator: Generator | None,
    ) -> None:
        self.contract, self.info, self.model, self.device = contract, info, model, device
        self.generator = generator
        self.transport = weight_sync.transport(contract)
        self.dtype: torch.dtype = getattr(torch, str(contract.spec.model.dtype))
        self._streamer: weight_sync.StreamSender | None = None  # created at the first stream

    def sync_at_start(self, version: int, *, resumed: bool) -> int:
        """Rollout servers start from the model on disk at version 0. After a resume, or when they
        already run newer versions (the gang restarted before its first save), push this policy
        under a version above all of theirs; returns the live version."""
        decision = None
        if self.generator is not None:
            live = self.generator.live_versions()
            newest = max(live.values(), default=0)
            if resumed or newest > 0:
                decision = max(version, newest) + 1
            else:
                self.generator.version = version
        decision = broadcast_json(decision, self.device)
        if decision is None:
            return version
        self.push(decision)
        return decision

    def push(self, version: int) -> None:
        """Send weight `version` to the rollout servers over the job's transport."""
        if self.transport == "collective":
            self._stream(version)
        else:
            self._post(version)

    def catch_up(self, servers: list[str], version: int) -> None:
        """Stream the live `version` to `servers` alone (ready, behind it: replacements), once; a
        failure is logged, not raised: generation, which waits on them, says what is still wrong."""
        if self.generator is not None:
            log.info("weights v%d: streaming it to %s, which came up behind it", version, ", ".join(servers))
        failed = broadcast_json(self._stream_once(version, only=servers), self.device)
        if failed:
            log.warning("weights v%d: catching up %s failed: %s", version, ", ".join(servers),
                        "; ".join(failed.values()))  # fmt: skip

    def _full_state_items(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """Collective: the unsharded weights (HF names), one tensor at a time. Over rank 0's EP
        group (other groups hold the same weights; None there), and under FSDP2 over the whole
        world, every rank taking part in each DTensor's `full_tensor()` (other groups' items are to
        be dropped)."""
        main = self.info.rank < self.info.ep_size
        sharded = any(isinstance(p, DTensor) for p in self.model.parameters())
        if not (main or sharded):
            return None
        return moe.iter_full_state_dict(self.model, gather_experts=main)

    def _post(self, version: int) -> None:
        """HTTP: gather the unsharded weights (collective, see `_full_state_items`), each tensor
        converted at once to the rollout dtype on the CPU; rank 0 sends them as `version`."""
        items = self._full_state_items()
        if items is None:
            return
        keep = self.generator is not None
        seen: set[int] = set()
        out = {}
        for name, t in items:  # tied tensors share storage, which safetensors refuses
            if not keep:
                continue  # still iterated: the gathers are collective
            ptr = t.data_ptr()
            t = t.detach().to("cpu", self.dtype)
            out[name] = t.clone() if ptr in seen else t
            seen.add(ptr)
        if self.generator is not None:
            self.generator.push(out, version)

    def _stream(self, version: int) -> None:
        """Collective transport, with the retries of the module doc."""
        for attempt in range(1, STREAM_ATTEMPTS + 1):
            failed = broadcast_json(self._stream_once(version), self.device)
            if failed is None:
                return
            if attempt < STREAM_ATTEMPTS:
                log.warning(
                    "weights v%d: no rollout server took it (%s); streaming it again to the servers "
                    "still up (attempt %d/%d)",
                    version, "; ".join(failed.values()), attempt + 1, STREAM_ATTEMPTS,
                )  # fmt: skip
                time.sleep(STREAM_RETRY_S)
        raise WeightSyncError(version, failed)

    def _stream_once(self, version: int, only: list[str] | None = None) -> dict[str, str] | None:
        """One try: rank 0 returns what failed when no server took the version (None elsewhere)."""
        contract, info = self.contract, self.info
        sync, backend = contract.spec.rollout.weight_sync, contract.trainer.backend
        host = contract.trainer.master_addr
        per_node = contract.spec.trainer.processes_per_pod  # one trainer pod per node
        plan = None
        if self.generator is not None:
            if self._streamer is None:  # rank 0 hosts the store first: its port goes out with the plan
                port = contract.trainer.weight_sync_port
                assert port is not None  # weight_sync.transport checked it
                self._streamer = weight_sync.StreamSender(
                    host,
                    port,
                    info.rank,
                    world=info.world_size,
                    ranks_per_node=per_node,
                    timeout_s=PUSH_TIMEOUT_S,
                )
            plan = {**self.generator.stream_plan(only), "port": self._streamer.port}
        plan = broadcast_json(plan, self.device)
        if not plan["servers"]:
            if self.generator is not None:
                self.generator.sent_to_none(version)
            return None
        if self._streamer is None:
            self._streamer = weight_sync.StreamSender(
                host,
                plan["port"],
                info.rank,
                world=info.world_size,
                ranks_per_node=per_node,
                timeout_s=PUSH_TIMEOUT_S,
            )
        pending = None
        shapes, experts = weight_sync.full_shapes(self.model), weight_sync.expert_tensors(self.model)
        check_holdings(plan, shapes, experts)
        if self.generator is not None:
            request = dict(
                store_host=host,
                store_port=plan["port"],
                backend=backend,
                feeders=weight_stream.feeders_for(
                    info.world_size, plan["members"], backend, per_node, len(plan["holdings"]) or 1
                ),
                timeout_s=PUSH_TIMEOUT_S,
                tensors=shapes,
                classes=plan["classes"],
                holdings=plan["holdings"],
                expert_tensors=experts,
            )
            streamer, epoch = self._streamer, plan["epoch"]
            pending = self.generator.stream(plan, version, request, lambda *_: streamer.call_off(epoch))
        t0 = time.monotonic()
        try:
            stats = self._streamer.send(
                weight_sync.owned_items(self.model, info.rank, info.world_size, info.ep_size),
                epoch=plan["epoch"],
                members=plan["members"],  # receiving members, all servers' together
                backend=backend,
                dtype=self.dtype,
                bucket_bytes=sync.bucket_mb << 20,
                device=self.device if backend == "nccl" else torch.device("cpu"),
                classes=plan["classes"],  # members holding only their experts receive those alone
                held=[Holding(None if h is None else tuple(h)) for h in plan["holdings"]],
                shapes=shapes,
                experts=experts,
            )
            log.info(
                "weights v%d: %d bucket(s), %.1f MB streamed in %.2fs (rank %d, at most %.1f MB held)",
                version,
                stats.buckets,
                stats.sent_bytes / 1e6,
                time.monotonic() - t0,
                info.rank,
                stats.peak_bytes / 1e6,
            )
        except Exception as e:  # a server left mid-stream: the servers' answers say who has the version
            log.warning("weights v%d: streaming from rank %d failed: %s", version, info.rank, e)
        if pending is None:
            return None
        try:
            result = pending.result(timeout=PUSH_TIMEOUT_S + 120)
        except WeightSyncError as e:
            return e.failures
        if result.failed:
            log.warning("weights v%d not taken by %s", version, ", ".join(result.failed))
        return None
