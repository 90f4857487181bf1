"""A receiving member keeps two payload buffers, from one weight version to the next, whatever the
number of trainer ranks sending.

Two, because the next round arrives while a round is applied; kept, because a fresh CPU buffer
costs its first-touch page faults (35 ms per 64 MiB measured) on the receiving side as on the
sending one; two and no more, because a member is in one group (its feeder's), so its reserve does
not grow with the trainer. Real trainer ranks in threads (`StreamSender`), a real receiver
(`ReceiverLink`, `receive_all`) over gloo groups on a real TCPStore; checked by the storage each
handed-out payload lives in.
"""

import threading

import pytest
import torch
from grpo_trainer.weight_sync import StreamSender
from grpo_wire import weight_stream

from tests.support.ports import free_port

BUCKET = 4096  # bytes: each rank's chunk of a round is a quarter of it at 2 ranks
SENDERS = 2


def _start_senders(epoch: int, versions: list[list[torch.Tensor]]) -> tuple[int, list, list]:
    senders = [StreamSender("127.0.0.1", free_port(), 0, world=SENDERS, timeout_s=30)]
    port = senders[0].port
    senders += [StreamSender("127.0.0.1", port, r, world=SENDERS, timeout_s=30) for r in range(1, SENDERS)]
    errors: list[BaseException] = []

    def send(rank: int) -> None:
        try:
            for values in versions:
                items = iter((f"s{rank}.t{i}", 0, v) for i, v in enumerate(values))
                senders[rank].send(
                    items, epoch=epoch, members=1, backend="gloo", dtype=torch.float32,
                    bucket_bytes=BUCKET, device=torch.device("cpu"),
                )  # fmt: skip
        except BaseException as e:  # reported by the test
            errors.append(e)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(SENDERS)]
    for t in threads:
        t.start()
    return port, threads, errors


def _groups(link: weight_stream.ReceiverLink, port: int, epoch: int) -> list[weight_stream.Group]:
    return link.groups_for(
        epoch=epoch, host="127.0.0.1", port=port, backend="gloo", feeders=1, members=1,
        member=0, timeout_s=30,
    )  # fmt: skip


def test_a_member_gets_two_buffers_kept_across_versions_and_dropped_with_the_groups():
    version = [torch.arange(2500, dtype=torch.float32) + i for i in range(3)]  # 30,000 B a rank
    port, threads, errors = _start_senders(1, [version, version])
    link = weight_stream.ReceiverLink()
    groups = _groups(link, port, 1)
    storages: list[dict[int, set[int]]] = []
    held: list[torch.Tensor] = []  # every payload stays alive: no fresh buffer can reuse its address
    for _ in range(2):
        seen: dict[int, set[int]] = {0: set()}
        got: dict[str, dict[int, torch.Tensor]] = {}

        def apply(bucket: weight_stream.Received) -> None:
            pieces, payload = bucket.pieces, bucket.payload
            seen[bucket.sender].add(payload.untyped_storage().data_ptr())  # noqa: B023
            held.append(payload)
            for p in pieces:
                got.setdefault(p.name, {})[p.start] = weight_stream.piece_values(payload, p).clone()  # noqa: B023

        received = weight_stream.receive_all(groups, torch.device("cpu"), apply, kept=link.buffers)
        assert received >= SENDERS * 3 * 2500 * 4
        for s in range(SENDERS):
            for i in range(3):
                parts = got[f"s{s}.t{i}"]
                assert torch.equal(torch.cat([parts[k] for k in sorted(parts)]), version[i])
        storages.append(seen)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(storages[0][0]) == 2, storages  # one applied, one arriving: two, from both ranks
    assert storages[1] == storages[0]  # the second version refilled the first one's buffers
    kept = {s: {b.untyped_storage().data_ptr() for b in bufs} for s, bufs in link.buffers.items()}
    assert kept == storages[0]
    link.reset()
    assert link.buffers == {}


def test_a_stream_that_breaks_leaves_no_buffer_behind():
    port, threads, errors = _start_senders(2, [[torch.ones(100)]])  # one round, then the end
    link = weight_stream.ReceiverLink()
    groups = _groups(link, port, 2)

    def refuse(bucket: weight_stream.Received) -> None:
        raise ValueError("bad bucket")

    with pytest.raises(ValueError, match="bad bucket"):
        weight_stream.receive_all(groups, torch.device("cpu"), refuse, kept=link.buffers)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert link.buffers == {}  # transfers of a broken stream may still write where they were going
