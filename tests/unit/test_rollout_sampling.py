"""The sampling policy's log-probs against hand-computed values (grpo_rollout.engines.sampling)."""

import math

import torch
from grpo_rollout.engines.sampling import policy_logprobs, sample_step


def test_temperature_only_is_log_softmax_of_scaled_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    got = policy_logprobs(logits, temperature=2.0, top_p=1.0)
    z = math.exp(1.0) + math.exp(0.5) + 1.0
    assert torch.allclose(got, torch.tensor([[1.0 - math.log(z), 0.5 - math.log(z), -math.log(z)]]))


def test_top_p_keeps_the_smallest_nucleus_and_renormalises():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    got = policy_logprobs(probs.log(), temperature=1.0, top_p=0.7)  # 0.5 < 0.7 <= 0.8: keep two tokens
    assert torch.allclose(got[0, :2].exp(), torch.tensor([0.625, 0.375]))
    assert torch.isinf(got[0, 2:]).all()
    exact = policy_logprobs(probs.log(), temperature=1.0, top_p=0.8)  # mass before token 3 is 0.8: dropped
    assert torch.isinf(exact[0, 2:]).all()


def test_top_p_always_keeps_the_most_likely_token():
    got = policy_logprobs(torch.tensor([[5.0, 0.0]]), temperature=1.0, top_p=0.01)
    assert got[0, 0].item() == 0.0 and torch.isinf(got[0, 1])


def test_sample_step_returns_the_logprob_of_the_token_it_drew():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 10, generator=g)
    tokens, logps = sample_step(logits, 0.7, 0.9, g)
    expected = policy_logprobs(logits, 0.7, 0.9).gather(1, tokens[:, None]).squeeze(1)
    assert torch.equal(logps, expected)
    assert torch.isfinite(logps).all()  # never a token outside the nucleus


def test_temperature_zero_is_greedy_with_the_plain_log_probs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 10, generator=g)
    tokens, logps = sample_step(logits, 0.0, 0.5, g)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.allclose(logps, torch.log_softmax(logits, dim=-1).max(dim=-1).values)
