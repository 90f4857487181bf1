"""A receiving member issues every group's transfers from one thread, in one global order.

NCCL requires the operations of different communicators to be issued in the same order on every
rank (a member is in one group today, its feeder's; the order holds for any number). Three real
sender threads (streams of 5, 1 and 0 buckets) and two real receivers over gloo
groups on a real TCPStore; each receiver's groups record the order of the broadcasts it issues.
Checked: both receivers issue the same sequence, it is the documented one (every sender's first
header; then per round the manifest of each sender with a bucket, then per such sender its payload
and next header, the next round posted before this one is handed out, which the trace shows by
noting each bucket as it is handed out), and every bucket arrives intact.
"""

import threading

import pytest
import torch
import torch.distributed as dist
from grpo_rollout import stream_member
from grpo_wire import weight_stream

from tests.support.ports import free_port

BUCKET = 1024  # bytes: 256 float32 per bucket
BUCKETS = [5, 1, 0]  # per sender: streams of different lengths, one with no bucket at all
MEMBERS = 2


class Traced(weight_stream.Group):
    """A real weight group that notes (sender, elements) of every broadcast this member issues."""

    def __init__(self, pg: dist.ProcessGroup, sender: int, trace: list) -> None:
        super().__init__(pg)
        self.sender, self.trace = sender, trace

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        self.trace.append((self.sender, tensor.numel()))
        return super().broadcast(tensor)


def expected_order(lengths: list[int], manifest_len: dict[tuple[int, int], int]) -> list:
    """The sequence `receive_rounds` documents, for senders with these bucket counts, with the
    buckets handed out ("apply", sender, bucket) among the broadcasts: every sender's first header;
    then per round the manifest of every sender with a bucket, then per such sender its payload and
    next header; round r + 1 is posted before round r is handed out (so it arrives while round r is
    applied)."""

    def posts(r: int) -> list:
        senders = [s for s, n in enumerate(lengths) if n > r]
        runs = [x for s in senders for x in ((s, BUCKET), (s, 3))]
        return [(s, manifest_len[s, r]) for s in senders] + runs

    order = [(s, 3) for s in range(len(lengths))] + posts(0)
    for r in range(max(lengths, default=0)):
        order += posts(r + 1) + [("apply", s, r) for s, n in enumerate(lengths) if n > r]
    return order


def test_every_member_issues_the_same_rounds_and_uneven_streams_arrive_whole():
    port = free_port()
    _server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # kept alive
    values = {
        s: [torch.arange(b * 256, (b + 1) * 256, dtype=torch.float32) + 1000 * s for b in range(n)]
        for s, n in enumerate(BUCKETS)
    }
    traces: list[list] = [[] for _ in range(MEMBERS)]
    got: list[dict] = [{} for _ in range(MEMBERS)]
    errors: list[BaseException] = []

    def sender(s: int) -> None:
        try:
            store = dist.PrefixStore(f"{weight_stream.STORE_PREFIX}/3/{s}", dist.TCPStore("127.0.0.1", port))
            group = weight_stream.form_group(store, 0, 1 + MEMBERS, "gloo", 30)
            works = []
            for b, v in enumerate(values[s]):  # one whole item a bucket, as a feeder forwards it
                piece = weight_stream.Piece(f"s{s}.b{b}", 0, v.numel(), 0, "float32")
                works += weight_stream.send_bucket(group, [piece], v.view(torch.uint8))
            works.append(weight_stream.send_end(group, torch.device("cpu")))
            for work in works:
                work.wait()
        except BaseException as e:
            errors.append(e)

    def member(m: int) -> None:
        try:
            tcp = dist.TCPStore("127.0.0.1", port)
            groups = []
            for s in range(len(BUCKETS)):
                store = dist.PrefixStore(f"{weight_stream.STORE_PREFIX}/3/{s}", tcp)
                group = weight_stream.form_group(store, 1 + m, 1 + MEMBERS, "gloo", 30)
                groups.append(Traced(group.pg, s, traces[m]))
            for s, pieces, payload, _ in weight_stream.receive_rounds(groups, torch.device("cpu")):
                for p in pieces:
                    got[m][p.name] = (s, weight_stream.piece_values(payload, p).clone())
                    traces[m].append(("apply", s, int(p.name.split(".b")[1])))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=sender, args=(s,)) for s in range(len(BUCKETS))]
    threads += [threading.Thread(target=member, args=(m,)) for m in range(MEMBERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert traces[0] == traces[1]
    manifest_len = {  # one whole item per bucket (256 float32 fill one exactly)
        (s, b): len(weight_stream.encode_manifest([weight_stream.Piece(f"s{s}.b{b}", 0, 256, 0, "float32")]))
        for s, n in enumerate(BUCKETS)
        for b in range(n)
    }
    assert traces[0] == expected_order(BUCKETS, manifest_len)
    for m in range(MEMBERS):
        assert set(got[m]) == {f"s{s}.b{b}" for s, n in enumerate(BUCKETS) for b in range(n)}
        for name, (s, v) in got[m].items():
            b = int(name.split(".b")[1])
            assert s == int(name[1]) and torch.equal(v, values[s][b])


def test_a_servers_outcome_is_its_worst_members():
    live = stream_member.Outcome("live", updated=7, loaded=True, received_bytes=10)
    refused = stream_member.Outcome("refused", "bad shape", loaded=False, received_bytes=10)
    broken = stream_member.Outcome("broken", "peer died", loaded=True)
    assert stream_member.combine([live, live]) == stream_member.Outcome("live", "", True, 7, 20)
    assert stream_member.combine([live, refused]).kind == "refused"
    assert stream_member.combine([refused, broken, live]).message == "peer died"
    assert stream_member.Outcome.from_dict(broken.to_dict()) == broken
    with pytest.raises(ValueError, match="no member outcomes"):
        stream_member.combine([])
