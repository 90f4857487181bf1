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


def test_bf16_experts_within_bf16_tolerance_of_fp32_forward_and_backward() -> None:
    """The compute dtype path: bf16 rows and weights against the fp32 computation (CPU bf16 mm)."""
    torch.manual_seed(0)
    counts, hidden, inter = [5, 0, 7, 4], 32, 16
    n = sum(counts)
    leaves = [
        torch.randn(n, hidden),
        torch.rand(n),
        torch.randn(4, 2 * inter, hidden) / 6,
        torch.randn(4, hidden, inter) / 4,
    ]
    ref = [t.clone().requires_grad_(True) for t in leaves]
    low = [t.clone().requires_grad_(True) for t in leaves]
    expected = grouped_swiglu(*ref, counts)
    out = grouped_swiglu(*(t.bfloat16() for t in low), counts)
    assert out.dtype == torch.bfloat16
    scale = expected.abs().max()
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=2e-2 * float(scale))
    probe = torch.randn_like(expected)
    (expected * probe).sum().backward()
    (out.float() * probe).sum().backward()
    for name, a, b in zip(("x", "weights", "gate_up", "down"), low, ref, strict=True):
        assert a.grad.dtype == torch.float32  # fp32 master gradients through the casts
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=2e-2 * float(b.grad.abs().max()), msg=name)


def test_moe_layer_dispatches_autocast_dtype_rows() -> None:
    """Under autocast the residual stream is fp32, but rows reach the experts in autocast's dtype."""
    from grpo_trainer.moe import GroupedExperts, MoELayer, Router, RouterConfig, make_dispatcher

    torch.manual_seed(0)
    cfg = RouterConfig(num_experts=4, top_k=2, score_func="softmax", norm_topk_prob=True)
    experts = GroupedExperts(torch.randn(4, 16, 8) / 3, torch.randn(4, 8, 8) / 3, num_experts=4)
    layer = MoELayer(Router(cfg, 8), experts, make_dispatcher("local", None, 4))
    seen: list[torch.dtype] = []
    experts.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
    x = torch.randn(2, 5, 8)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert seen == [torch.float32, torch.bfloat16]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=3e-2 * float(ref.abs().max()))
