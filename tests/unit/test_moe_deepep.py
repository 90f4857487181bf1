"""The DeepEP dispatcher core (`grpo_trainer.moe.deepep`) on CPU, behind a fake one-rank exchange.

The fake does what DeepEP does for a group of one rank (dispatch returns the tokens with their
local expert ids and the host-side count per expert; combine is the identity, with weights;
backward of each is the other), so the core's own work — expanding received tokens into rows by
local expert, the autograd wiring, the dtypes, counting host syncs — is checked against the
`local` reference, forward and backward. DeepEP itself needs GPUs: benchmarks/gpu/.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from grpo_trainer.moe.deepep import DeepEPDispatcher, local_expert_order, row_dtype
from grpo_trainer.moe.dispatch import ExchangeClock, LocalDispatcher, expand_by_local_expert


class FakeExchange:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def dispatch(self, x, topk_idx, topk_weights, num_experts):
        self.calls.append("dispatch")
        assert x.dtype == torch.bfloat16 and topk_idx.dtype == torch.int64
        assert topk_weights.dtype == torch.float32
        counts = torch.bincount(topk_idx.reshape(-1), minlength=num_experts).tolist()  # DeepEP's host list
        return x.clone(), topk_idx.clone(), topk_weights.clone(), counts, "handle"

    def redispatch(self, x, handle):
        self.calls.append("redispatch")
        assert handle == "handle" and x.dtype == torch.bfloat16
        return x.clone()

    def combine(self, x, handle, topk_weights=None):
        self.calls.append("combine")
        assert handle == "handle" and x.dtype == torch.bfloat16
        return x.clone(), None if topk_weights is None else topk_weights.clone()


class OneRank(DeepEPDispatcher):
    def __init__(self, num_experts: int) -> None:  # no process group: one rank
        self.world, self.num_experts, self.num_local = 1, num_experts, num_experts
        self.bytes_sent, self.clock, self.fake = 0, ExchangeClock(), FakeExchange()

    def exchange(self, hidden: int, top_k: int) -> FakeExchange:
        return self.fake


def routed(seed: int, tokens: int = 9, hidden: int = 8, experts: int = 6, k: int = 2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).float()  # bf16-exact
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    idx[0] = torch.arange(k)  # expert 0 busy, the last expert possibly empty
    w = torch.rand(tokens, k, generator=gen)
    return x, idx, w


def run(dispatcher, x, idx, w):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    sent = dispatcher.dispatch(x, idx, w)
    rows = sent.rows * sent.weights[:, None] * 3.0  # an "expert" that scales and applies the weight
    out = dispatcher.combine(rows, sent.handle)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return sent.counts, out.detach(), x.grad, w.grad


def test_deepep_core_matches_the_local_reference_forward_and_backward() -> None:
    x, idx, w = routed(0)
    ref = run(LocalDispatcher(None, 6), x, idx, w)
    got = run(OneRank(6), x, idx, w)
    assert got[0] == ref[0]  # rows per expert: DeepEP's list, used as is
    for a, b, what in zip(got[1:], ref[1:], ("output", "x grad", "weight grad"), strict=True):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=2e-2, msg=what)  # bf16 on the wire


def test_backward_is_the_opposite_op_with_the_same_handle() -> None:
    dispatcher = OneRank(6)
    run(dispatcher, *routed(1))
    assert dispatcher.fake.calls == ["dispatch", "combine", "redispatch", "combine"]


@contextlib.contextmanager
def counting_host_syncs() -> Iterator[list[str]]:
    """Count the calls that sync with the host on a GPU (`item`, `tolist`, `bool`, `nonzero`...)."""
    seen: list[str] = []
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def counter(name):
        def call(self, *a, **k):
            seen.append(name)
            return saved[name](self, *a, **k)

        return call

    try:
        for n in names:
            setattr(torch.Tensor, n, counter(n))
        yield seen
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_no_host_sync_of_our_own_per_layer() -> None:
    """DeepEP's own CPU sync gives the counts; the core adds none (the fake's bincount, which
    stands for DeepEP's, is excluded by counting only outside it)."""
    dispatcher = OneRank(6)
    x, idx, w = routed(2)
    fake_dispatch = dispatcher.fake.dispatch
    inside: list[int] = []

    with counting_host_syncs() as seen:

        def dispatch(*a):
            before = len(seen)
            out = fake_dispatch(*a)
            inside.append(len(seen) - before)
            return out

        dispatcher.fake.dispatch = dispatch
        run(dispatcher, x, idx, w)
    assert len(seen) - sum(inside) == 0, seen


def test_expanded_order_agrees_with_the_counting_version() -> None:
    recv_idx = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])
    order, counts = expand_by_local_expert(recv_idx, 3)
    assert torch.equal(local_expert_order(recv_idx, counts, 3), order)


@pytest.mark.parametrize("autocast", [False, True])
def test_rows_stay_bf16_under_bf16_autocast(autocast: bool) -> None:
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert row_dtype(x) == (torch.bfloat16 if autocast else torch.float32)
        x, idx, w = routed(3)
        sent = OneRank(6).dispatch(x, idx, w)
        assert sent.rows.dtype == (torch.bfloat16 if autocast else torch.float32)
