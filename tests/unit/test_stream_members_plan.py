"""Who receives a streamed version and what it costs: the stream plan's member ranks, the request's
bounds, the vLLM workers' member numbering, and the memory reserve both the engine and the plan use.
"""

import json
from pathlib import Path

import pytest
import yaml
from grpo_operator import instance_types, memory_plan
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.roles import NCCL_COMM_BYTES, stream_receive_reserve
from grpo_rollout.engines.vllm_engine import Assembler, VllmOptions, memory_utilization, stream_members
from grpo_rollout.engines.vllm_stream import member_index
from grpo_trainer.generation import member_ranks
from grpo_wire.protocol import WeightStreamRequest
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
GIB, MIB = 1 << 30, 1 << 20


def test_each_server_gets_consecutive_member_ranks_after_the_servers_before_it():
    assert member_ranks([1, 8, 2]) == ([0, 1, 9], 11)
    assert member_ranks([]) == ([], 0)


def test_a_request_names_a_first_member_inside_the_group():
    shared = dict(version=1, epoch=0, store_host="h", store_port=1, backend="gloo", feeders=2, tensors={})
    assert WeightStreamRequest(members=9, first_member=8, **shared).first_member == 8
    with pytest.raises(ValidationError, match="first_member 9 out of range for 9 members"):
        WeightStreamRequest(members=9, first_member=9, **shared)


class Parallel:
    def __init__(self, dp: int, world: int, rank: int) -> None:
        self.data_parallel_index, self.world_size, self.rank = dp, world, rank


def test_vllm_workers_are_numbered_as_vllms_own_weight_transfer_numbers_them():
    assert [member_index(Parallel(dp, 4, r)) for dp in range(2) for r in range(4)] == list(range(8))
    assert stream_members([1, 0, 3, 2]) == 4
    with pytest.raises(RuntimeError, match=r"indices \[0, 0\], not 0..1"):
        stream_members([0, 0])


def test_the_reserve_lowers_what_vllm_is_given_and_refuses_when_nothing_is_left():
    reserve = stream_receive_reserve(16, 256 * MIB)
    assert reserve == 2 * (128 * MIB + 16 * 16) + NCCL_COMM_BYTES  # two half-buckets, one communicator
    # whatever the trainer's size: 128 ranks (16 p5en) add 2 x 112 x 16 B of control blocks
    assert stream_receive_reserve(128, 256 * MIB) - reserve == 2 * 112 * 16
    gpu = instance_types.BUILTIN.get("p5.48xlarge").gpu_memory_bytes
    opts = VllmOptions(gpu_memory_utilization=0.9, stream_reserve_bytes=reserve)
    assert memory_utilization(opts, gpu) == pytest.approx(0.9 - reserve / gpu)
    assert memory_utilization(opts, None) == 0.9  # CPU: no fixed budget
    assert memory_utilization(VllmOptions(), gpu) == 0.9  # HTTP: nothing streamed
    starved = VllmOptions(gpu_memory_utilization=0.005, stream_reserve_bytes=reserve)
    with pytest.raises(ValueError, match=r"lower rollout\.weightSync\.bucketMb"):
        memory_utilization(starved, gpu)


def test_the_plan_shows_the_same_reserve_and_takes_it_from_the_kv_room():
    job = GRPOJob.model_validate(yaml.safe_load((ROOT / "examples" / "p5-qwen3-30b-a3b.yaml").read_text()))
    config = json.loads((ROOT / "tests/data/model-configs/qwen3-30b-a3b.config.json").read_text())
    gpu = instance_types.BUILTIN.get("p5.48xlarge").gpu_memory_bytes
    spec = job.spec
    senders = spec.trainer.replicas * spec.trainer.processes_per_pod
    streamed = memory_plan.plan_job(config, spec, trainer_gpu_bytes=gpu, rollout_gpu_bytes=gpu).rollout
    part = streamed.parts["weight_stream"]
    assert part.bytes == stream_receive_reserve(senders, spec.rollout.weight_sync.bucket_mb * MIB)
    http = job.model_copy(deep=True)
    http.spec.rollout.weight_sync.transport = "http"
    plain = memory_plan.plan_job(config, http.spec, trainer_gpu_bytes=gpu, rollout_gpu_bytes=gpu).rollout
    assert "weight_stream" not in plain.parts
    assert plain.parts["kv_cache"].bytes - streamed.parts["kv_cache"].bytes == part.bytes


def test_every_assembled_tensor_owns_its_storage_as_vllms_reload_keeps_it_past_the_bucket():
    import torch

    assembler = Assembler({"a": [2, 3], "b": [4]})
    whole = torch.arange(6, dtype=torch.float32)
    out = assembler.add([("a", 0, whole), ("b", 0, torch.tensor([1.0, 2.0]))])
    assert set(out) == {"a"} and out["a"].shape == (2, 3)
    whole.zero_()  # the bucket is reused for the next one
    assert torch.equal(out["a"].reshape(-1), torch.arange(6, dtype=torch.float32))
    assert assembler.missing() == ["b"]
    out = assembler.add([("b", 2, torch.tensor([3.0, 4.0]))])
    assert torch.equal(out["b"], torch.tensor([1.0, 2.0, 3.0, 4.0])) and assembler.missing() == []
    with pytest.raises(ValueError, match="already completed"):
        assembler.add([("a", 0, whole)])


def test_a_vllm_server_takes_its_reserve_from_the_jobs_trainer_ranks_and_buckets():
    from grpo_rollout.engines.vllm_engine import vllm_options

    job = GRPOJob.model_validate(yaml.safe_load((ROOT / "examples" / "p5-qwen3-30b-a3b.yaml").read_text()))
    spec = job.spec
    senders = spec.trainer.replicas * spec.trainer.processes_per_pod
    bucket = spec.rollout.weight_sync.bucket_mb * MIB
    assert vllm_options(spec).stream_reserve_bytes == stream_receive_reserve(senders, bucket) > 0
    http = job.model_copy(deep=True)
    http.spec.rollout.weight_sync.transport = "http"
    assert vllm_options(http.spec).stream_reserve_bytes == 0


def test_members_holding_the_same_experts_share_a_class_and_whole_model_streams_have_none():
    from grpo_trainer.generation import member_classes

    # two 2-member EP servers (linear placement of 8 experts) and a torch-engine server
    servers = [(2, [[0, 1, 2, 3], [4, 5, 6, 7]]), (2, [[0, 1, 2, 3], [4, 5, 6, 7]]), (1, None)]
    classes, holdings = member_classes(servers)
    assert classes == [0, 1, 0, 1, 2] and holdings == [[0, 1, 2, 3], [4, 5, 6, 7], None]
    assert member_classes([(1, None), (8, None)]) == ([], [])  # everyone the whole model: no classes
    assert member_classes([(2, [[3, 1], [1, 3]])]) == ([0, 0], [[1, 3]])  # the same experts, any order


def test_a_request_gives_every_member_one_of_its_holdings():
    shared = dict(version=1, epoch=0, store_host="h", store_port=1, backend="gloo", feeders=1, tensors={})
    req = WeightStreamRequest(members=3, first_member=0, classes=[0, 1, 0], holdings=[[0, 1], None], **shared)
    assert req.holding(2).experts == (0, 1) and req.holding(1).experts is None
    for bad in (dict(classes=[0, 1], holdings=[[0], None]), dict(classes=[0, 2, 0], holdings=[[0], None])):
        with pytest.raises(ValidationError, match="classes must give each of the 3 members"):
            WeightStreamRequest(members=3, first_member=0, **bad, **shared)
