"""Policy losses (clipped GRPO ratio with separate low/high clips, GSPO sequence ratio), hand-computed."""

import math

import pytest
import torch
from grpo_trainer.losses import POLICY_LOSSES, clipped_token_loss, gspo_token_loss


def test_clipped_loss_uses_separate_low_and_high_clips() -> None:
    # ratios 1.5, 0.5, 0.5, 1.5 with advantages +1, +1, -1, -1; clips 1-0.2=0.8 and 1+0.28=1.28
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    logp = torch.log(ratio).requires_grad_(True)
    old = torch.zeros(1, 4)
    # per-token advantage: one sequence per token so each token gets its own sign
    loss, clipped = clipped_token_loss(
        logp.T, old.T, torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.ones(4, 1), clip_low=0.2, clip_high=0.28
    )
    # min(1.5, 1.28)=1.28 (clipped); min(0.5, 0.8)=0.5; min(-0.5, -0.8)=-0.8 (clipped); min(-1.5, -1.28)=-1.5
    assert torch.allclose(loss.squeeze(-1), torch.tensor([-1.28, -0.5, 0.8, 1.5]))
    assert clipped.squeeze(-1).tolist() == [1.0, 0.0, 1.0, 0.0]
    loss.sum().backward()
    # d(-r A)/dlogp = -r A where unclipped, 0 where clipped
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5]]))


def test_clipped_loss_at_ratio_one_is_minus_advantage() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    loss, clipped = clipped_token_loss(
        logp, logp.clone(), torch.tensor([0.7]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2
    )
    assert torch.allclose(loss, torch.tensor([[-0.7, -0.7]]))
    assert clipped.sum() == 0


def test_gspo_uses_the_length_normalised_sequence_ratio() -> None:
    # log-ratios [ln 2, 0] over 2 real tokens (third is padding): s = exp(ln2 / 2) = sqrt 2
    logp = torch.tensor([[math.log(2.0), 0.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clipped = gspo_token_loss(
        logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.5
    )
    s = math.sqrt(2.0)
    assert torch.allclose(loss[:, :2], torch.tensor([[-s, -s]]))
    assert clipped[:, :2].sum() == 0
    # gradient of the sequence-mean of the token loss equals d(-s)/dlogp_t = -s / 2 per real token
    ((loss * mask).sum() / 2).backward()
    assert torch.allclose(logp.grad[:, :2], torch.tensor([[-s / 2, -s / 2]]))


def test_gspo_clips_the_whole_sequence() -> None:
    # mean log-ratio ln 2 -> s = 2 > 1 + 0.5 with A = +1: every token clipped, no gradient
    logp = torch.tensor([[math.log(4.0), 0.0]], requires_grad=True)
    loss, clipped = gspo_token_loss(
        logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.5
    )
    assert torch.allclose(loss, torch.tensor([[-1.5, -1.5]]))
    assert clipped.tolist() == [[1.0, 1.0]]
    loss.sum().backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_negative_advantage_pushes_log_probs_down(name: str) -> None:
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    loss, _ = POLICY_LOSSES[name](
        logp, logp.detach(), torch.tensor([-1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2
    )
    loss.sum().backward()
    assert (logp.grad > 0).all()  # gradient descent lowers them
