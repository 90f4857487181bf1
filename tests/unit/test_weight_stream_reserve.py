"""The law of the weight stream's memory: a receiving member's reserve does not grow with the trainer.

At 1, 2, 4 and 8 trainer ranks (real `StreamSender` relays in threads, gloo groups on a real
TCPStore) streaming the same model to one member (`ReceiverLink`, `receive_all`): the member is in
one group, keeps two buffers, and their bytes stay within one bucket of each other (exactly: 32 B
more per trainer rank, its control blocks) and within the plan's reserve
(`api.roles.stream_receive_reserve`, the same formula the vLLM engine takes out of its budget);
every rank's relay holds at most two buckets. Before the relay a member kept two buckets and a
communicator per trainer rank: 96 GiB per GPU at 128 ranks.
"""

import threading

import torch
from grpo_operator.api.roles import (
    NCCL_COMM_BYTES,
    STREAM_CONTROL_BYTES,
    stream_bucket_bytes,
    stream_chunk_bytes,
    stream_receive_reserve,
)
from grpo_trainer.weight_sync import CONTROL, StreamSender, share
from grpo_wire import holdings, weight_stream

from tests.support.ports import free_port

BUCKET = 64 << 10
MODEL = {f"w{i}": torch.randn(8192) for i in range(12)}  # 384 KiB of fp32, 192 KiB in bf16


def stream_from(world: int) -> tuple[int, int, list[int], dict[str, torch.Tensor]]:
    """(groups the member is in, bytes its kept buffers hold, each rank's relay peak, what arrived)."""
    senders = [StreamSender("127.0.0.1", free_port(), 0, world=world, timeout_s=60)]
    port = senders[0].port
    senders += [StreamSender("127.0.0.1", port, r, world=world, timeout_s=60) for r in range(1, world)]
    peaks, errors = [0] * world, []

    def send(rank: int) -> None:
        try:
            items = []
            for name, t in MODEL.items():
                lo, hi = share(t.numel(), rank, world)
                items.append((name, lo, t[lo:hi]))
            stats = senders[rank].send(
                iter(items), epoch=1, members=1, backend="gloo", dtype=torch.bfloat16, bucket_bytes=BUCKET,
                device=torch.device("cpu"),
            )  # fmt: skip
            peaks[rank] = stats.peak_bytes
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    link = weight_stream.ReceiverLink()
    feeders = weight_stream.feeders_for(world, 1, "gloo")
    groups = link.groups_for(
        epoch=1,
        host="127.0.0.1",
        port=port,
        backend="gloo",
        feeders=feeders,
        members=1,
        member=0,
        timeout_s=60,
    )
    got = {k: torch.zeros(v.numel(), dtype=torch.bfloat16) for k, v in MODEL.items()}

    def apply(bucket: weight_stream.Received) -> None:
        for p in bucket.pieces:
            got[p.name][p.start : p.start + p.count] = weight_stream.piece_values(bucket.payload, p)

    weight_stream.receive_all(groups, torch.device("cpu"), apply, kept=link.buffers)
    for t in threads:
        t.join(60)
    assert not errors, errors
    kept = sum(b.numel() for bufs in link.buffers.values() for b in bufs)
    return len(groups), kept, peaks, got


def test_a_members_reserve_is_flat_in_the_trainers_size_and_within_the_plan():
    kept = {}
    for world in (1, 2, 4, 8):
        groups, kept[world], peaks, got = stream_from(world)
        assert groups == 1  # one communicator, whatever the number of ranks
        for name, values in MODEL.items():
            assert torch.equal(got[name], values.to(torch.bfloat16)), (world, name)
        assert kept[world] <= 2 * stream_bucket_bytes(world, BUCKET)
        assert kept[world] + NCCL_COMM_BYTES <= stream_receive_reserve(world, BUCKET)
        assert all(0 < peak <= 2 * BUCKET for peak in peaks), (world, peaks)
    assert max(kept.values()) - min(kept.values()) <= BUCKET, kept  # flat: within one bucket
    assert kept[8] - kept[1] <= 2 * 8 * CONTROL  # exactly: the control blocks


def test_the_plans_bucket_is_the_runtimes_largest_and_at_most_half_a_bucket_of_weights():
    assert STREAM_CONTROL_BYTES == CONTROL == weight_stream.ALIGN
    for world in (1, 2, 16, 128, 1024):
        for bucket in (1 << 20, 64 << 20, 256 << 20):
            chunk = stream_chunk_bytes(world, bucket)  # what the relay plans with (plan_chunks)
            assert chunk % weight_stream.ALIGN == 0 and world * chunk <= bucket // 2
            assert stream_bucket_bytes(world, bucket) == world * (CONTROL + chunk)


def test_nccl_feeds_from_one_rank_a_node_and_gloo_from_as_many_ranks_as_members():
    assert weight_stream.feeders_for(128, 256, "nccl", 8) == 16  # the seed: 16 trainer nodes
    assert weight_stream.feeders_for(16, 4, "nccl", 8) == 2
    assert weight_stream.feeders_for(4, 8, "nccl", 8) == 1  # a gang smaller than a node
    assert weight_stream.feeders_for(16, 1, "nccl", 8) == 1  # never more feeders than members
    # members in holding classes: a feeder per class where there are ranks enough (no passes)
    assert weight_stream.feeders_for(128, 256, "nccl", 8, classes=32) == 32  # the seed: EP 32 servers
    assert weight_stream.feeders_for(8, 16, "nccl", 8, classes=32) == 8  # fewer ranks: passes
    assert weight_stream.feeders_for(2, 4, "gloo", classes=4) == 2
    assert weight_stream.feeders_for(2, 2, "gloo", 8) == 2 and weight_stream.feeders_for(4, 3, "gloo") == 3
    members = 37
    for feeders in (1, 5, 16):  # every member in exactly one feeder's group
        lanes = holdings.lanes([0] * members, feeders)
        sizes = [lanes.sizes[(0, f)] - 1 for f in range(feeders)]
        assert sum(sizes) == members and max(sizes) - min(sizes) <= 1
        assert lanes.place == [(0, m % feeders, 1 + m // feeders) for m in range(members)]


def test_the_process_group_calls_the_relay_makes_on_nccl_are_the_ones_gloo_runs_here():
    """On a GPU the exchange group is a ProcessGroupNCCL: the relay calls the same methods of their
    common c10d `Backend` the gloo tests above run for real (alltoall_base with split sizes,
    allgather, broadcast, abort); pinned here, since no GPU runs it."""
    import torch.distributed as dist

    backend = dist.ProcessGroupGloo.__mro__[1]  # torch._C._distributed_c10d.Backend
    assert backend in dist.ProcessGroupNCCL.__mro__
    doc = backend.alltoall_base.__doc__
    assert "output_split_sizes" in doc and "input_split_sizes" in doc
    for method in ("alltoall_base", "allgather", "broadcast", "abort"):
        assert callable(getattr(backend, method)), method
