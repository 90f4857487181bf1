"""Aggregations, truncated importance sampling and the composed GRPO loss, hand-computed."""

import math

import pytest
import torch
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_trainer.losses import AGGREGATIONS, LossConfig, Totals, grpo_loss, truncated_is_weight

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
TOTALS = Totals(tokens=4, sequences=2, norm_len=5)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("token-mean", 10 / 4),  # (1+2+3+4) / 4 tokens
        ("sequence-mean", (2 + 4) / 2),  # per-sequence means 2 and 4
        ("token-sum-norm", 10 / (2 * 5)),  # sum / (2 sequences x 5)
    ],
)
def test_aggregations(name: str, expected: float) -> None:
    assert AGGREGATIONS[name](LOSS, MASK, TOTALS).item() == pytest.approx(expected)


def test_truncated_is_weight_caps_and_has_no_gradient() -> None:
    old = torch.zeros(3, requires_grad=True)
    rollout = torch.log(torch.tensor([0.25, 2.0, 1.0]))
    w = truncated_is_weight(old, rollout, cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, 0.5, 1.0]))  # 4 capped at 2
    assert not w.requires_grad


def test_composed_loss_by_hand() -> None:
    # one sequence, two tokens, ratio 1, A = +1 -> policy loss -1 per token
    # IS: pi_old/pi_rollout = [0.5/0.5, 0.5/1.0] = [1, 0.5]          -> [-1, -0.5]
    # KL k3 vs ref [0.25, 0.5]: [0.193147, 0] x 0.1                  -> [+0.0193147, 0]
    # entropy [1, 2] x 0.01                                           -> [-0.01, -0.02]
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, is_cap=2.0)
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    loss, metrics = grpo_loss(
        cfg,
        logp=logp,
        old_logp=logp,
        advantages=torch.tensor([1.0]),
        mask=torch.ones(1, 2),
        totals=Totals(tokens=2, sequences=1, norm_len=2),
        rollout_logp=torch.log(torch.tensor([[0.5, 1.0]])),
        ref_logp=torch.log(torch.tensor([[0.25, 0.5]])),
        entropy=torch.tensor([[1.0, 2.0]]),
    )
    k3 = 0.5 - 1 + math.log(2)
    assert loss.item() == pytest.approx((-1 + 0.1 * k3 - 0.01 - 0.5 - 0.02) / 2)
    assert metrics["is_weight"] == pytest.approx(0.75)
    assert metrics["kl"] == pytest.approx(k3 / 2)
    assert metrics["entropy"] == pytest.approx(1.5)
    assert metrics["clip_frac"] == 0.0


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("policy", ["grpo", "gspo"])
def test_micro_batches_sum_to_the_full_batch_gradient(aggregation: str, policy: str) -> None:
    torch.manual_seed(0)
    cfg = LossConfig(policy_loss=policy, aggregation=aggregation, kl_coef=0.05, clip_low=0.1, clip_high=0.1)
    b, t = 8, 6
    logp = (torch.randn(b, t) * 0.3 - 1).requires_grad_(True)
    old = logp.detach() + torch.randn(b, t) * 0.1
    ref = logp.detach() + torch.randn(b, t) * 0.1
    rollout = logp.detach() + torch.randn(b, t) * 0.1
    adv = torch.randn(b)
    lengths = torch.randint(1, t + 1, (b,))
    mask = (torch.arange(t) < lengths.unsqueeze(-1)).float()
    totals = Totals(tokens=float(mask.sum()), sequences=b, norm_len=t)
    args = {"old_logp": old, "advantages": adv, "mask": mask, "rollout_logp": rollout, "ref_logp": ref}

    full, _ = grpo_loss(cfg, logp=logp, totals=totals, **args)
    (g_full,) = torch.autograd.grad(full, logp)
    total = torch.zeros(())
    for i in range(0, b, 3):  # uneven micro-batches: 3, 3, 2
        part, _ = grpo_loss(
            cfg, logp=logp[i : i + 3], totals=totals, **{k: v[i : i + 3] for k, v in args.items()}
        )
        total = total + part
    (g_micro,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(full.item(), rel=1e-5)
    assert torch.allclose(g_micro, g_full, atol=1e-6)


def test_config_from_spec() -> None:
    algo = AlgorithmSpec(
        policyLoss="gspo", importanceSampling="none", lossAggregation="sequence-mean", klCoef=0.1
    )
    cfg = LossConfig.from_spec(algo)
    assert (cfg.policy_loss, cfg.is_cap, cfg.aggregation, cfg.kl_coef) == ("gspo", None, "sequence-mean", 0.1)
    assert LossConfig.from_spec(AlgorithmSpec()).is_cap == 2.0


def test_config_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'"):
        LossConfig(policy_loss="ppo")
