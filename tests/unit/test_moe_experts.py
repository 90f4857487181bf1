"""The grouped SwiGLU matches a per-expert loop, forward and backward, empty experts included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from grpo_trainer.moe import grouped_swiglu


def loop_reference(x, weights, gate_up, down, counts):
    """The obvious implementation: one SwiGLU per expert on its slice of rows."""
    outs, start, inter = [], 0, down.shape[-1]
    for e, c in enumerate(counts):
        h = x[start : start + c] @ gate_up[e].T
        outs.append((F.silu(h[:, :inter]) * h[:, inter:] * weights[start : start + c, None]) @ down[e].T)
        start += c
    return torch.cat(outs)


@pytest.mark.parametrize("inter", [4, 8])  # routing weight applied before / after the down projection
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [0, 0, 0, 0], [2, 2, 2, 2]])
def test_grouped_swiglu_matches_loop(counts: list[int], inter: int) -> None:
    torch.manual_seed(0)
    hidden, n = 6, sum(counts)
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
