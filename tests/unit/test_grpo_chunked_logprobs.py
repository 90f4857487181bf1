"""Log-probs and entropy in token chunks equal the full-vocabulary computation, gradients included.

`grpo_trainer.losses.chunked_token_stats` is what the trainer's `forward_logp` runs after the
decoder: the head and log-softmax per chunk, recomputed per chunk in backward.
"""

import math

import pytest
import torch
from grpo_trainer.losses import chunked_token_stats, token_entropy, token_logprobs


def _setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 7, 16, generator=g, dtype=torch.float64).float().requires_grad_(True)
    head = torch.nn.Linear(16, 50, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=g))
    targets = torch.randint(0, 50, (3, 7), generator=g)
    return hidden, head, targets


@pytest.mark.parametrize("chunk", [1, 4, 21, 64])
def test_chunked_equals_unchunked_values_and_gradients(chunk: int) -> None:
    hidden, head, targets = _setup()
    w = torch.randn(3, 7)
    logits = head(hidden).float() / 0.7
    full_lp, full_ent = token_logprobs(logits, targets), token_entropy(logits)
    ((full_lp * w).sum() + full_ent.sum()).backward()
    ref_h, ref_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None

    lp, ent = chunked_token_stats(hidden, head, targets, 0.7, chunk_tokens=chunk, entropy=True)
    ((lp * w).sum() + ent.sum()).backward()
    torch.testing.assert_close(lp, full_lp, rtol=1e-6, atol=1e-5)  # fp32 rounding of a row-blocked matmul
    torch.testing.assert_close(ent, full_ent, rtol=1e-6, atol=1e-5)  # fp32 rounding of a row-blocked matmul
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.weight.grad, ref_w, rtol=1e-5, atol=1e-5)


def test_no_entropy_unless_asked_and_no_graph_without_grad() -> None:
    hidden, head, targets = _setup(1)
    lp, ent = chunked_token_stats(hidden, head, targets, 1.0, chunk_tokens=5)
    assert ent is None and lp.shape == (3, 7) and lp.requires_grad
    with torch.no_grad():
        lp2, _ = chunked_token_stats(hidden, head, targets, 1.0, chunk_tokens=5)
    assert not lp2.requires_grad
    torch.testing.assert_close(lp2, lp.detach())


def test_full_vocab_logits_live_one_chunk_at_a_time() -> None:
    """What autograd keeps between forward and backward holds no [tokens, V] tensor."""
    hidden, head, targets = _setup(2)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_stats(hidden, head, targets, 1.0, chunk_tokens=4, entropy=True)
    vocab_wide = [s for s in saved if s[-1:] == (50,) and math.prod(s) > 4 * 50]
    assert saved and not vocab_wide, saved
