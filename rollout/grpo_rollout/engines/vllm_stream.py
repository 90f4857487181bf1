"""Inside a vLLM worker: the worker is a member of every weight group and loads what it receives.

`VllmEngine.receive_stream` calls `WeightLoader.grpo_receive_stream` on every worker (one per
tensor-parallel and pipeline rank, per data-parallel replica) through `collective_rpc`; each worker
runs `receive_in_worker`: it joins the trainer's groups at its own rank (the server's first member
plus its index among the engine's workers, computed as vLLM's own NCCL weight-transfer engine does),
receives every bucket straight onto its device and feeds it to vLLM's layerwise reload, where the
model's `load_weights` keeps the shard this worker needs from the full tensor. Nothing passes
through the host or the server process. The worker keeps its `ReceiverLink` across versions (the
groups of an epoch are formed once). The outcome goes back as a plain dict (`Outcome.to_dict`):
vLLM's RPC carries no exception types.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from grpo_wire import weight_stream
from grpo_wire.protocol import WeightStreamRequest

from grpo_rollout import stream_member
from grpo_rollout.engines.base import BucketPiece
from grpo_rollout.engines.hf_names import CheckpointNames
from grpo_rollout.engines.vllm_engine import Assembler, checkpoint_named


def member_index(parallel_config: Any) -> int:
    """This worker's index among its engine's workers: data-parallel replica, then its rank in
    the replica's tensor × pipeline world (vLLM's `worker_init_process_group` numbers them so)."""
    return int(parallel_config.data_parallel_index) * int(parallel_config.world_size) + int(
        parallel_config.rank
    )


class WorkerUpdate:
    """`StreamedUpdate` inside one vLLM worker, over the `WeightLoader` steps (reload begin,
    load, finish or abort); names are checked and mapped to the checkpoint's as in the engine."""

    def __init__(self, worker: Any, names: CheckpointNames) -> None:
        self.worker, self.names = worker, names
        self._assembler: Assembler | None = None

    def begin_update(self, tensors: Mapping[str, Sequence[int]]) -> None:
        checkpoint_named(self.names, {k: torch.empty(tuple(v), device="meta") for k, v in tensors.items()})
        self._assembler = Assembler(tensors)
        self.worker.grpo_begin_update()

    def load_bucket(self, pieces: Sequence[BucketPiece]) -> None:
        if self._assembler is None:
            raise ValueError("load_bucket without begin_update")
        whole = checkpoint_named(self.names, self._assembler.add(pieces))
        if whole:
            self.worker.grpo_load_tensors(whole)

    def finish_update(self) -> int:
        if self._assembler is None:
            raise ValueError("finish_update without begin_update")
        if missing := self._assembler.missing():
            raise ValueError(f"{len(missing)} tensor(s) never arrived, e.g. {missing[:3]}")
        self._assembler = None
        return int(self.worker.grpo_finish_update())

    def abort_update(self) -> None:
        self._assembler = None
        self.worker.grpo_abort_update()


def receive_in_worker(worker: Any, request_json: str, refused: bool) -> dict[str, Any]:
    """One worker's part of a streamed version (see the module doc); `refused`: consume, drop."""
    req = WeightStreamRequest.model_validate_json(request_json)
    state = worker.__dict__
    link = state.setdefault("_grpo_link", weight_stream.ReceiverLink())
    if "_grpo_names" not in state:
        state["_grpo_names"] = CheckpointNames(worker.vllm_config.model_config.model)
    member = req.first_member + member_index(worker.vllm_config.parallel_config)
    device = torch.device("cpu") if req.backend == "gloo" else torch.device(worker.device)
    updater = None if refused else WorkerUpdate(worker, state["_grpo_names"])
    return stream_member.receive(link, req, member, device, updater).to_dict()
