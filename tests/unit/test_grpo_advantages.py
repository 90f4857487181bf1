"""Advantage estimators, zero-variance filtering and the overlong penalty against hand-computed values."""

import math

import pytest
import torch
from grpo_trainer.advantages import (
    STD_EPS,
    group_mean_advantages,
    group_std_advantages,
    overlong_penalty,
    zero_variance_mask,
)


def test_group_std_divides_by_unbiased_std() -> None:
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.57735
    adv = group_std_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    a = 0.5 / (math.sqrt(1 / 3) + STD_EPS)
    assert torch.allclose(adv, torch.tensor([[a, -a, -a, a]]), atol=1e-6)


def test_group_std_is_zero_not_nan_for_equal_rewards() -> None:
    adv = group_std_advantages(torch.tensor([[2.0, 2.0, 2.0]]))
    assert torch.equal(adv, torch.zeros(1, 3))


def test_group_mean_subtracts_the_mean_only() -> None:
    adv = group_mean_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]]))
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]]))


def test_groups_are_normalised_independently() -> None:
    # the second group has 10x the spread: group-std gives both the same advantages
    r = torch.tensor([[0.0, 1.0], [0.0, 10.0]])
    adv = group_std_advantages(r)
    assert torch.allclose(adv[0], adv[1], atol=1e-3)
    assert not torch.allclose(group_mean_advantages(r)[0], group_mean_advantages(r)[1])


def test_zero_variance_mask_keeps_groups_with_signal() -> None:
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    assert zero_variance_mask(r).tolist() == [False, True, False]


@pytest.mark.parametrize(
    ("length", "expected"),
    [(5, 1.0), (6, 1.0), (8, 0.5), (10, 0.0), (12, 0.0)],
)
def test_overlong_penalty_is_linear_inside_the_buffer(length: int, expected: float) -> None:
    # limit 10, buffer 4: free up to 6 tokens, then -0.25 per token, full penalty 1.0 at 10 and beyond
    out = overlong_penalty(
        torch.tensor([1.0]), torch.tensor([length]), max_new_tokens=10, buffer_tokens=4, penalty=1.0
    )
    assert out.item() == pytest.approx(expected)


def test_overlong_penalty_scales_with_penalty() -> None:
    out = overlong_penalty(
        torch.tensor([0.0]), torch.tensor([9]), max_new_tokens=10, buffer_tokens=4, penalty=2.0
    )
    assert out.item() == pytest.approx(-1.5)  # 3 of 4 buffer tokens used x 2.0
