"""The law of the weight stream's bytes: a member receives what it holds, not the whole model.

Real `StreamSender` relays (threads, gloo groups on a real TCPStore) stream an MoE-shaped model
(dense tensors and fused routed-expert tensors, dim 0 the expert) to one server of k members that
each hold one EP rank's experts as vLLM places them (linear or round-robin), beside a server that
holds the whole model (the torch engine). Each member goes through `stream_member.receive`: it
goes live only when every element it holds arrived exactly once, and a piece it does not hold
would be refused. Measured: received bytes / held bytes <= 1.1, plus one bucket, at 2 and 4 members
per server and 1, 2 and 4 trainer ranks; the whole-model member still gets every byte.
"""

import math
import threading

import pytest
import torch
from grpo_rollout import stream_member
from grpo_trainer.generation import member_classes
from grpo_trainer.weight_sync import StreamSender, share
from grpo_wire import holdings, weight_stream
from grpo_wire.holdings import Holding
from grpo_wire.protocol import WeightStreamRequest

from tests.support.ports import free_port

BUCKET = 64 << 10
EXPERTS = 8
MODEL = {
    "embed.weight": torch.randn(64, 32),
    "layers.0.attn.weight": torch.randn(32, 32),
    "layers.0.mlp.experts.gate_up_proj": torch.randn(EXPERTS, 64, 32),
    "layers.0.mlp.experts.down_proj": torch.randn(EXPERTS, 32, 32),
    "layers.1.attn.weight": torch.randn(32, 32),
    "layers.1.mlp.experts.gate_up_proj": torch.randn(EXPERTS, 64, 32),
    "layers.1.mlp.experts.down_proj": torch.randn(EXPERTS, 32, 32),
}
EXPERT_TENSORS = sorted(n for n in MODEL if ".experts." in n)
SHAPES = {k: list(v.shape) for k, v in MODEL.items()}


class Recorder:
    """A member's engine: the pieces it was given, into zeros (bf16, as the wire carries them)."""

    def __init__(self) -> None:
        self.got = {k: torch.zeros(v.numel(), dtype=torch.bfloat16) for k, v in MODEL.items()}

    def begin_update(self, tensors) -> None:
        assert dict(tensors) == SHAPES

    def load_bucket(self, pieces) -> None:
        for name, start, values in pieces:
            self.got[name][start : start + values.numel()] = values

    def finish_update(self) -> int:
        return len(self.got)

    def abort_update(self) -> None:
        pass


def held_bytes(holding: Holding) -> int:
    experts = frozenset(EXPERT_TENSORS)
    return 2 * sum(hi - lo for n, s in SHAPES.items() for lo, hi in holding.ranges(n, s, experts))


def stream(world: int, servers: list[tuple[int, list[list[int] | None] | None]]):
    """Stream MODEL from `world` ranks to `servers` ((members, experts each holds)); per member its
    outcome and recorder, and the request the members got."""
    classes, held = member_classes(servers)
    members = sum(k for k, _ in servers)
    senders = [StreamSender("127.0.0.1", free_port(), 0, world=world, timeout_s=60)]
    port = senders[0].port
    senders += [StreamSender("127.0.0.1", port, r, world=world, timeout_s=60) for r in range(1, world)]
    errors: list[BaseException] = []

    def send(rank: int) -> None:
        try:
            items = []
            for name, t in MODEL.items():
                flat = t.reshape(-1)
                lo, hi = share(flat.numel(), rank, world)
                items.append((name, lo, flat[lo:hi]))
            senders[rank].send(
                iter(items), epoch=1, members=members, backend="gloo", dtype=torch.bfloat16,
                bucket_bytes=BUCKET, device=torch.device("cpu"), classes=classes,
                held=[Holding(None if h is None else tuple(h)) for h in held], shapes=SHAPES,
                experts=EXPERT_TENSORS,
            )  # fmt: skip
        except BaseException as e:  # reported by the test
            errors.append(e)

    request = WeightStreamRequest(
        version=1, epoch=1, store_host="127.0.0.1", store_port=port, backend="gloo", members=members,
        feeders=weight_stream.feeders_for(world, members, "gloo", 1, len(held) or 1), first_member=0,
        timeout_s=60,
        tensors=SHAPES, classes=classes, holdings=held, expert_tensors=EXPERT_TENSORS,
    )  # fmt: skip
    results: list = [None] * members

    def receive(member: int) -> None:
        recorder = Recorder()
        outcome = stream_member.receive(
            weight_stream.ReceiverLink(), request, member, torch.device("cpu"), recorder
        )
        results[member] = (outcome, recorder)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(world)]
    threads += [threading.Thread(target=receive, args=(m,)) for m in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results, request


@pytest.mark.parametrize(
    ("world", "per_server", "placement"),
    [(1, 2, "linear"), (2, 2, "linear"), (2, 4, "linear"), (4, 4, "round_robin")],
)
def test_each_member_receives_what_it_holds_and_no_more(world: int, per_server: int, placement: str) -> None:
    ep = [holdings.expert_placement(k, per_server, EXPERTS, placement) for k in range(per_server)]
    results, request = stream(world, [(per_server, ep), (1, None)])
    whole = held_bytes(Holding())
    dense = 2 * sum(math.prod(s) for n, s in SHAPES.items() if n not in EXPERT_TENSORS)
    for member, (outcome, recorder) in enumerate(results):
        holding = request.holding(member)
        assert outcome.kind == "live", (member, outcome)
        held = held_bytes(holding)
        assert outcome.received_bytes <= 1.1 * held + BUCKET, (member, outcome.received_bytes, held)
        for name, values in MODEL.items():
            want = values.reshape(-1).to(torch.bfloat16)
            for lo, hi in holding.ranges(name, SHAPES[name], frozenset(EXPERT_TENSORS)):
                assert torch.equal(recorder.got[name][lo:hi], want[lo:hi]), (member, name)
        if holding.experts is None:
            assert held == whole  # the torch engine's server still gets the whole model
        else:  # an EP member keeps the dense part and its experts' share
            experts = 2 * sum(math.prod(s) for n, s in SHAPES.items() if n in EXPERT_TENSORS)
            assert held == dense + experts * len(holding.experts) // EXPERTS
    # what the EP members received together is one copy of the experts and k of the dense part
    ep_total = sum(results[m][0].received_bytes for m in range(per_server))
    assert ep_total <= 1.1 * (whole + (per_server - 1) * dense) + per_server * BUCKET


def test_without_holdings_every_member_receives_the_whole_model() -> None:
    results, request = stream(2, [(2, None)])
    assert request.classes == [] and request.holding(1) == Holding()
    for outcome, recorder in results:
        assert outcome.kind == "live" and outcome.received_bytes >= held_bytes(Holding())
        for name, values in MODEL.items():
            assert torch.equal(recorder.got[name], values.reshape(-1).to(torch.bfloat16))


def test_vllms_expert_placements() -> None:
    assert [holdings.expert_placement(r, 3, 8) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [holdings.expert_placement(r, 3, 8, "round_robin") for r in range(3)] == [
        [0, 3, 6],
        [1, 4, 7],
        [2, 5],
    ]
    assert holdings.expert_placement(0, 1, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="unknown expert placement 'eplb'"):
        holdings.expert_placement(0, 2, 8, "eplb")


def test_lanes_put_every_member_in_one_group_fed_by_its_class() -> None:
    for classes, feeders in (([0, 1, 2, 3, 0, 1, 2, 3], 2), ([0, 1, 2, 3, 4], 8), ([0] * 5, 3)):
        lanes = holdings.lanes(classes, feeders)
        seen: dict[tuple[int, int], int] = {}
        for m, (p, f, rank) in enumerate(lanes.place):
            assert lanes.passes[p][f] == classes[m]  # its feeder forwards its class in its pass
            seen[(p, f)] = max(seen.get((p, f), 0), rank)
        assert {k: v + 1 for k, v in seen.items()} == lanes.sizes  # ranks 1..n, no gaps
    assert len(holdings.lanes([0, 1, 2, 3], 2).passes) == 2  # more classes than feeders: passes


def test_a_piece_outside_what_a_member_holds_is_refused() -> None:
    from grpo_rollout.weights import BadBucket, Coverage

    name = "layers.0.mlp.experts.down_proj"
    held = {name: holdings.held_ranges(SHAPES[name], [1, 2])}
    coverage = Coverage(SHAPES, held)
    with pytest.raises(BadBucket, match="not in what this member holds"):
        coverage.add(name, 0, 10)
    coverage.add(name, 1024, 2048)
    assert name not in coverage.missing()


def test_a_server_holding_experts_the_model_lacks_fails_naming_it() -> None:
    from grpo_trainer.pusher import check_holdings

    plan = {
        "servers": ["http://a", "http://b"],
        "first": [0, 1],
        "classes": [0, 1, 2],
        "holdings": [None, [0], [9]],
    }
    with pytest.raises(ValueError, match=r"rollout server http://b \(member 2\) holds routed experts \[9\]"):
        check_holdings(plan, SHAPES, EXPERT_TENSORS)
    check_holdings(plan | {"holdings": [None, [0], [7]]}, SHAPES, EXPERT_TENSORS)
    check_holdings({"servers": ["http://a"], "first": [0], "classes": [], "holdings": []}, SHAPES, [])
