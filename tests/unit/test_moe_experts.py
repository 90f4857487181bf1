"""The grouped SwiGLU matches a per-expert loop, forward and backward, empty experts included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from grpo_trainer.moe import grouped_swiglu, make_dispatcher
from grpo_trainer.moe.dispatch import expand_by_local_expert


def loop_reference(x, weights, gate_up, down, counts):
    """The obvious implementation: one SwiGLU per expert on its slice of rows."""
    outs, start, inter = [], 0, down.shape[-1]
    for e, c in enumerate(counts):
        h = x[start : start + c] @ gate_up[e].T
        outs.append((F.silu(h[:, :inter]) * h[:, inter:] * weights[start : start + c, None]) @ down[e].T)
        start += c
    return torch.cat(outs)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [0, 0, 0, 0], [2, 2, 2, 2]])
def test_grouped_swiglu_matches_loop(counts: list[int]) -> None:
    torch.manual_seed(0)
    hidden, inter, n = 6, 4, sum(counts)
    leaves = [
        torch.randn(n, hidden, dtype=torch.float64),
        torch.rand(n, dtype=torch.float64),
        torch.randn(4, 2 * inter, hidden, dtype=torch.float64),
        torch.randn(4, hidden, inter, dtype=torch.float64),
    ]
    ours = [t.clone().requires_grad_(True) for t in leaves]
    ref = [t.clone().requires_grad_(True) for t in leaves]
    out = grouped_swiglu(*ours, counts)
    expected = loop_reference(*ref, counts)
    torch.testing.assert_close(out, expected)
    probe = torch.randn_like(expected)
    (out * probe).sum().backward()
    (expected * probe).sum().backward()
    for name, a, b in zip(("x", "weights", "gate_up", "down"), ours, ref, strict=True):
        expected_grad = b.grad if b.grad is not None else torch.zeros_like(b)
        torch.testing.assert_close(a.grad, expected_grad, msg=name)


def test_grouped_swiglu_rejects_inconsistent_counts() -> None:
    with pytest.raises(ValueError):
        grouped_swiglu(torch.randn(3, 4), torch.ones(3), torch.randn(2, 4, 4), torch.randn(2, 4, 2), [1, 1])


def test_expand_by_local_expert_sorts_valid_slots_by_expert() -> None:
    recv_idx = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]])  # (received token, slot)
    order, counts = expand_by_local_expert(recv_idx, 3)
    assert counts == [2, 1, 2]
    assert (order // 2).tolist() == [1, 3, 3, 0, 1]  # tokens of expert 0, then 1, then 2
    assert recv_idx.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2]


def test_local_dispatch_groups_rows_by_expert_and_combine_sums_per_token() -> None:
    dispatcher = make_dispatcher("local", None, 4)
    x = torch.arange(3.0).repeat_interleave(2).view(3, 2)  # token t has value t
    idx = torch.tensor([[2, 0], [2, 3], [0, 2]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 2.0]])
    sent = dispatcher.dispatch(x, idx, weights)
    assert sent.counts == [2, 0, 3, 1]
    assert sent.rows[:, 0].tolist() == [0, 2, 0, 1, 2, 1]
    assert sent.weights.tolist() == [0.5, 1.0, 0.5, 0.25, 2.0, 0.75]
    combined = dispatcher.combine(sent.rows * sent.weights[:, None], sent.handle)
    torch.testing.assert_close(combined, x * weights.sum(1, keepdim=True))
