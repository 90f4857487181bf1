"""A receiving member keeps two payload buffers per sender, from one weight version to the next.

Two, because the next round arrives while a round is applied; kept, because a fresh CPU buffer
costs its first-touch page faults (35 ms per 64 MiB measured) on the receiving side as on the
sending one. Real sender threads (`BucketSender`), a real receiver (`ReceiverLink`, `receive_all`)
over gloo groups on a real TCPStore; checked by the storage each handed-out payload lives in.
"""

import threading

import pytest
import torch
import torch.distributed as dist
from grpo_rollout import weight_stream

from tests.support.ports import free_port

BUCKET = 4096  # bytes: 1024 float32
SENDERS = 2


def _send(port: int, epoch: int, s: int, versions: list[list[torch.Tensor]], errors: list) -> None:
    try:
        store = dist.PrefixStore(
            f"{weight_stream.STORE_PREFIX}/{epoch}/{s}", dist.TCPStore("127.0.0.1", port)
        )
        group = weight_stream.form_group(store, 0, 2, "gloo", 30)
        for values in versions:
            items = iter((f"s{s}.t{i}", 0, v) for i, v in enumerate(values))
            weight_stream.BucketSender(group, torch.float32, BUCKET, torch.device("cpu")).send(items)
    except BaseException as e:  # reported by the test
        errors.append(e)


def _start_senders(port: int, epoch: int, versions: list[list[torch.Tensor]]) -> tuple[list, list]:
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_send, args=(port, epoch, s, versions, errors)) for s in range(SENDERS)
    ]
    for t in threads:
        t.start()
    return threads, errors


def _groups(link: weight_stream.ReceiverLink, port: int, epoch: int) -> list[weight_stream.Group]:
    return link.groups_for(
        epoch=epoch, host="127.0.0.1", port=port, backend="gloo", senders=SENDERS, members=1,
        member=0, timeout_s=30,
    )  # fmt: skip


def test_each_sender_gets_two_buffers_kept_across_versions_and_dropped_with_the_groups():
    port = free_port()
    _server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # kept alive
    version = [torch.arange(2500, dtype=torch.float32) + i for i in range(3)]  # 30,000 B: 8 buckets
    threads, errors = _start_senders(port, 1, [version, version])
    link = weight_stream.ReceiverLink()
    groups = _groups(link, port, 1)
    storages: list[dict[int, set[int]]] = []
    held: list[torch.Tensor] = []  # every payload stays alive: no fresh buffer can reuse its address
    for _ in range(2):
        seen: dict[int, set[int]] = {s: set() for s in range(SENDERS)}
        got: dict[str, list[torch.Tensor]] = {}

        def apply(bucket: weight_stream.Received) -> None:
            pieces, payload = bucket.pieces, bucket.payload
            seen[int(pieces[0].name[1])].add(payload.untyped_storage().data_ptr())  # noqa: B023
            held.append(payload)
            for p in pieces:
                got.setdefault(p.name, []).append(weight_stream.piece_values(payload, p).clone())  # noqa: B023

        received = weight_stream.receive_all(groups, torch.device("cpu"), apply, kept=link.buffers)
        assert received == SENDERS * 3 * 2500 * 4
        assert all(torch.equal(torch.cat(got[f"s{s}.t{i}"]), version[i]) for s in range(2) for i in range(3))
        storages.append(seen)
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(len(storages[0][s]) == 2 for s in range(SENDERS)), storages  # one applied, one arriving
    assert storages[1] == storages[0]  # the second version refilled the first one's buffers
    kept = {s: {b.untyped_storage().data_ptr() for b in bufs} for s, bufs in link.buffers.items()}
    assert kept == storages[0]
    link.reset()
    assert link.buffers == {}


def test_a_stream_that_breaks_leaves_no_buffer_behind():
    port = free_port()
    _server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # kept alive
    threads, errors = _start_senders(port, 2, [[torch.ones(100)]])  # one bucket each, then the end
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
