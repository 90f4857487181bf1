"""The DeepEP dispatcher core (`grpo_trainer.moe.deepep`) on CPU, behind a fake one-rank exchange.

The fake does what DeepEP does for a group of one rank (dispatch returns the tokens with their
local expert ids and the host-side count per expert; combine is the identity, with weights;
backward of each is the other), so the core's own work — expanding received tokens into rows by
local expert, the autograd wiring, the dtypes, counting host syncs — is checked against the
`local` reference, forward and backward. DeepEP itself needs GPUs: benchmarks/gpu/.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator

import pytest
import torch
from grpo_trainer.moe.autoselect import EPShape, round_trip_seconds
from grpo_trainer.moe.backends import deepep_v2
from grpo_trainer.moe.backends.local import LocalDispatcher
from grpo_trainer.moe.deepep import (
    DeepEPDispatcher,
    chunk_count,
    comm_ptr_problem,
    local_expert_order,
    row_dtype,
)
from grpo_trainer.moe.dispatch import ExchangeClock, expand_by_local_expert


class FakeExchange:
    def __init__(self, max_tokens: int | None = None) -> None:
        self.calls: list[str] = []
        self.max_tokens = max_tokens  # DeepEP v2's buffer cap; None: v1, any count

    def dispatch(self, x, topk_idx, topk_weights, num_experts):
        self.calls.append("dispatch")
        assert self.max_tokens is None or x.shape[0] <= self.max_tokens, "above the buffer's cap"
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
    def __init__(self, num_experts: int, max_tokens: int | None = None) -> None:  # no group: one rank
        self.world, self.num_experts, self.num_local = 1, num_experts, num_experts
        self.bytes_sent, self.clock, self.fake = 0, ExchangeClock(), FakeExchange(max_tokens)

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


def test_a_layer_above_the_buffer_cap_is_dispatched_in_chunks_and_matches_the_reference() -> None:
    x, idx, w = routed(4, tokens=9)
    ref = run(LocalDispatcher(None, 6), x, idx, w)
    dispatcher = OneRank(6, max_tokens=4)  # 9 tokens: 3 chunks of at most 4
    got = run(dispatcher, x, idx, w)
    assert dispatcher.fake.calls.count("dispatch") == 3 and dispatcher.fake.calls.count("redispatch") == 3
    assert got[0] == ref[0]  # rows per expert over all chunks: the experts still run once
    for a, b, what in zip(got[1:], ref[1:], ("output", "x grad", "weight grad"), strict=True):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=2e-2, msg=what)


def test_auto_measures_a_micro_batch_above_the_v2_cap() -> None:
    """The issue's case: 4 x 8192 = 32,768 tokens per rank against a 16,384-token buffer."""
    tokens, cap = 4 * 8192, deepep_v2.DEFAULT_MAX_TOKENS
    dispatcher = OneRank(6, max_tokens=deepep_v2.buffer_tokens(tokens, cap))
    shape = EPShape(hidden=8, top_k=2, tokens=tokens)
    assert round_trip_seconds(dispatcher, shape, 6, "cpu", iters=1) > 0
    assert dispatcher.fake.calls.count("dispatch") == 2 * 2  # warm-up + 1 timed, 2 chunks each


@pytest.mark.parametrize(
    ("most", "cap", "chunks"),
    [(9, 4, 3), (8, 4, 2), (1, 4, 1), (0, 4, 1), (32768, 16384, 2), (10**6, None, 1)],
)
def test_chunk_count_covers_the_busiest_rank(most: int, cap: int | None, chunks: int) -> None:
    assert chunk_count(most, cap) == chunks


def test_v2_buffer_is_sized_for_one_dispatch_at_most_the_cap() -> None:
    assert deepep_v2.buffer_tokens(32768, 16384) == 16384
    assert deepep_v2.buffer_tokens(4096, 16384) == 4096
    assert deepep_v2.buffer_tokens(None, 16384) == 16384


# ElasticBuffer's keyword parameters at the Dockerfile's DEEPEP_COMMIT (dd758ca,
# deep_ep/buffers/elastic.py), read from the source: what our calls may pass.
V2_DISPATCH_PARAMS = {
    "topk_idx", "topk_weights", "cumulative_local_expert_recv_stats", "num_experts",
    "num_max_tokens_per_rank", "expert_alignment", "num_sms", "num_qps", "previous_event",
    "previous_event_before_epilogue", "async_with_compute_stream", "allocate_on_comm_stream",
    "handle", "do_handle_copy", "do_cpu_sync", "do_expand", "do_zero_padding",
    "use_tma_aligned_col_major_sf",
}  # fmt: skip
V2_COMBINE_PARAMS = {
    "topk_weights", "bias", "num_sms", "num_qps", "previous_event", "previous_event_before_epilogue",
    "async_with_compute_stream", "allocate_on_comm_stream",
}  # fmt: skip


def test_every_v2_call_passes_a_positive_sm_count() -> None:
    """Upstream's dispatch runs `get_theoretical_num_sms(num_experts, ...)` when num_sms is 0, and
    a cached dispatch (our backward of combine) leaves num_experts None there: TypeError."""
    first = deepep_v2.dispatch_kwargs(128, 16384, 12, 33)
    cached = deepep_v2.cached_dispatch_kwargs(12, 33)
    combine = deepep_v2.combine_kwargs(12, 33)
    for kwargs in (first, cached, combine):
        assert kwargs["num_sms"] == 12 and kwargs["num_qps"] == 33
    assert set(first) | set(cached) <= V2_DISPATCH_PARAMS and set(combine) <= V2_COMBINE_PARAMS
    assert first["num_experts"] == 128 and first["do_cpu_sync"] is True
    with pytest.raises(ValueError, match="positive SM and QP"):
        deepep_v2.cached_dispatch_kwargs(0, 33)


def test_sm_and_qp_counts_are_the_setting_or_v2s_estimate_never_zero() -> None:
    def unused() -> int:
        raise AssertionError("a configured count needs no estimate")

    assert deepep_v2.resolve_count("sms", 12, unused) == 12
    assert deepep_v2.resolve_count("sms", None, lambda: 24) == 24
    with pytest.raises(ValueError, match="GRPO_DEEPEP_NUM_SMS"):
        deepep_v2.resolve_count("sms", None, lambda: 0)


# ElasticBuffer.__init__'s keyword parameters at DEEPEP_COMMIT (elastic.py:228-246), read from the source.
V2_BUFFER_PARAMS = {
    "num_bytes", "num_cpu_bytes", "num_max_tokens_per_rank", "hidden", "num_topk", "use_fp8_dispatch",
    "deterministic", "allow_hybrid_mode", "allow_multiple_reduction", "prefer_overlap_with_compute",
    "sl_idx", "num_allocated_qps", "num_cpu_timeout_secs", "num_gpu_timeout_secs", "explicitly_destroy",
}  # fmt: skip


def test_on_efa_v2_runs_upstreams_capped_qps_and_allocates_only_those() -> None:
    """DeepEP PR #612: QPs capped at 2 on EFA (129 overflow aws-ofi-nccl's 128-slot GIN ring)."""
    assert deepep_v2.settings({"FI_PROVIDER": "efa"}) == (16384, 12, 2)
    assert deepep_v2.settings({"FI_PROVIDER": "efa", "GRPO_DEEPEP_NUM_QPS": "8"})[2] == 8  # overridable
    assert deepep_v2.settings({}) == (16384, None, None)  # elsewhere v2's own estimates
    assert deepep_v2.allocated_qps(2) == 2 and deepep_v2.allocated_qps(None) == 0
    with pytest.raises(ValueError, match="GRPO_DEEPEP_NUM_QPS"):
        deepep_v2.allocated_qps(0)
    source = inspect.getsource(deepep_v2.V2Exchange.__init__)
    passed = set(re.findall(r"^\s+(\w+)=", source.split("ElasticBuffer(")[1].split(")\n")[0], re.M))
    assert "num_allocated_qps" in passed and passed <= V2_BUFFER_PARAMS, passed


def test_v2_refuses_a_communicator_torch_has_not_created() -> None:
    why = comm_ptr_problem(0, reuse_torch_comm=True)
    assert why is not None and "_comm_ptr() is 0" in why and "device_id" in why
    assert comm_ptr_problem(0x7F00, reuse_torch_comm=True) is None
    assert comm_ptr_problem(0, reuse_torch_comm=False) is None  # EP_REUSE_NCCL_COMM=0: DeepEP's own
    assert comm_ptr_problem(None, reuse_torch_comm=True) is None  # no _comm_ptr: DeepEP's own
