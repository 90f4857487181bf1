"""KL estimators, entropy and per-token log-probs against hand-computed values."""

import math

import pytest
import torch
from grpo_trainer.losses import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, token_entropy, token_logprobs

LOGP = torch.tensor([math.log(0.5)])
REF = torch.tensor([math.log(0.25)])


def test_k1_is_the_log_ratio() -> None:
    assert kl_k1(LOGP, REF).item() == pytest.approx(math.log(2.0))  # 0.693147


def test_k2_is_half_the_squared_log_ratio() -> None:
    assert kl_k2(LOGP, REF).item() == pytest.approx(0.5 * math.log(2.0) ** 2)  # 0.240227


def test_k3_is_ratio_minus_one_minus_log_ratio() -> None:
    # ref/pi = 0.5: 0.5 - 1 - ln 0.5 = 0.193147
    assert kl_k3(LOGP, REF).item() == pytest.approx(0.5 - 1 + math.log(2.0))


@pytest.mark.parametrize("name", ["k2", "k3"])
def test_nonnegative_estimators_vanish_at_equality(name: str) -> None:
    x = torch.randn(5)
    assert torch.allclose(KL_ESTIMATORS[name](x, x), torch.zeros(5))
    assert (KL_ESTIMATORS[name](x, torch.randn(5)) >= 0).all()


def test_token_logprobs_picks_the_target() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]]))
    out = token_logprobs(logits + 3.0, torch.tensor([[0, 2]]))  # shift-invariant
    assert torch.allclose(out, torch.log(torch.tensor([[0.5, 0.7]])))


def test_token_entropy_of_known_distributions() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.25, 0.25, 0.25 + 1e-12]]]))
    h = token_entropy(logits)
    # 0.5 ln 2 + 2 x 0.25 ln 4 = 1.039721; (nearly) uniform over 3 = ln 3
    assert h[0, 0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(4), abs=1e-6)
    assert h[0, 1].item() == pytest.approx(math.log(3), abs=1e-6)
