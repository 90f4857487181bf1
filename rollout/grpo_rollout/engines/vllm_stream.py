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
from grpo_wire.holdings import expert_placement
from grpo_wire.protocol import WeightStreamRequest

from grpo_rollout import stream_member
from grpo_rollout.engines.base import BucketPiece
from grpo_rollout.engines.hf_names import CheckpointNames
from grpo_rollout.engines.vllm_engine import Assembler, checkpoint_named


def held_experts(vllm_config: Any) -> list[int] | None:
    """The routed experts this worker keeps, as vLLM places them, or None (it keeps every expert, or
    a layout this does not map: pipeline stages). Under expert parallelism vLLM's EP group is the
    server's TP x DP workers (`FusedMoEParallelConfig.make` flattens TP across DP,
    fused_moe/config.py:1189-1233 of 0.32.0) and a worker's EP rank is its member index."""
    pc = vllm_config.parallel_config
    ep = int(pc.tensor_parallel_size) * int(pc.data_parallel_size)
    if not pc.enable_expert_parallel or ep <= 1 or int(pc.pipeline_parallel_size) > 1:
        return None
    if getattr(pc, "enable_eplb", False):  # not a knob of ours: refuse rather than send the wrong rows
        raise ValueError("vLLM's EPLB moves experts at run time: the trainer cannot send each its own")
    hf = vllm_config.model_config.hf_text_config
    counts = (getattr(hf, k, None) for k in ("num_experts", "n_routed_experts", "num_local_experts"))
    experts = next((int(v) for v in counts if v), None)
    if experts is None:
        raise ValueError(f"{type(hf).__name__} names no routed-expert count: cannot place its experts")
    strategy = str(getattr(pc, "expert_placement_strategy", "linear"))
    return expert_placement(member_index(pc), ep, experts, strategy)


def experts_in_model(model: Any) -> list[int] | None:
    """The routed experts this worker's own MoE layers keep, in local-slot order, as vLLM placed them
    (each layer's `expert_map_manager.expert_map`: global id -> local slot, -1 elsewhere; None without
    expert parallelism; vllm 0.32.0 fused_moe/expert_map_manager.py:302-311, held by every
    RoutedExperts, routed_experts.py:126), or None where no layer maps experts. Layers that place
    experts differently are refused: the trainer sends one set of rows per worker."""
    found: list[int] | None = None
    first = ""
    for name, module in model.named_modules():
        manager = getattr(module, "expert_map_manager", None)
        mapping = getattr(manager, "expert_map", None)
        if mapping is None:
            continue
        slots = mapping[: int(manager.global_num_experts)].tolist()  # past it: AITER's fused shared experts
        experts = [e for _, e in sorted((slot, e) for e, slot in enumerate(slots) if slot >= 0)]
        if found is None:
            found, first = experts, name
        elif experts != found:
            why = f"{first} keeps {found[:8]}, {name} keeps {experts[:8]}"
            raise ValueError(f"vLLM's layers place experts differently: {why}")
    return found


def member_index(parallel_config: Any) -> int:
    """This worker's index among its engine's workers: data-parallel replica, then its rank in
    the replica's tensor × pipeline world (vLLM's `worker_init_process_group` numbers them so)."""
    return int(parallel_config.data_parallel_index) * int(parallel_config.world_size) + int(
        parallel_config.rank
    )


class WorkerUpdate:
    """`StreamedUpdate` inside one vLLM worker, over the `WeightLoader` steps (reload begin,
    load, finish or abort); names are checked and mapped to the checkpoint's as in the engine."""

    def __init__(self, worker: Any, names: CheckpointNames, held: Mapping[str, Sequence[int]] | None = None):
        self.worker, self.names = worker, names
        self.held = dict(held or {})  # per fused expert tensor, the experts this worker keeps
        self._assembler: Assembler | None = None

    def begin_update(self, tensors: Mapping[str, Sequence[int]]) -> None:
        checkpoint_named(self.names, {k: torch.empty(tuple(v), device="meta") for k, v in tensors.items()})
        self._assembler = Assembler(tensors, self.held)
        self.worker.grpo_begin_update()

    def load_bucket(self, pieces: Sequence[BucketPiece]) -> None:
        if self._assembler is None:
            raise ValueError("load_bucket without begin_update")
        whole = checkpoint_named(self.names, self._assembler.add(pieces), self._assembler.experts_of)
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
    experts = req.holding(member).experts  # this worker's routed experts, when it declared them
    held = {} if experts is None else {name: experts for name in req.expert_tensors}
    updater = None if refused else WorkerUpdate(worker, state["_grpo_names"], held)
    return stream_member.receive(link, req, member, device, updater).to_dict()
