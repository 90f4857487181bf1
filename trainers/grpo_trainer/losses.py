"""GRPO loss maths: policy losses, KL estimators, aggregations, and the one function composing them.

Called by the training loop (`grpo_trainer.loop`) once per micro-batch. Every variant is a
small function registered by name in its registry (`@POLICY_LOSSES.register`, `KL_ESTIMATORS`,
`AGGREGATIONS`; `grpo_wire.registry`); `grpo_loss` looks them up by the names the GRPOJob spec uses,
so adding a variant is one decorated function, its value in the API enum and its test — never an
if/elif chain.

Shapes: B sequences (completions) per micro-batch, T completion tokens (right-padded);
`mask` is 1.0 on real completion tokens. Log-probs are of the sampled tokens, [B, T].
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_wire.registry import Registry
from torch.utils.checkpoint import checkpoint

PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AggregationFn = Callable[..., torch.Tensor]
"""(per-token loss, mask, Totals) -> the micro-batch's scalar loss."""

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", home=__name__)
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator", home=__name__)
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation", home=__name__)


@POLICY_LOSSES.register("grpo")
def clipped_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO token loss -min(r A, clip(r, 1-lo, 1+hi) A) with r = π/π_old per token.

    Separate low/high clips (DAPO's clip-higher) let rare good tokens grow faster than
    common ones shrink. Returns (loss [B, T], clipped [B, T] as 0/1 for the clip fraction);
    `mask` is part of the shared signature, unused here because each token stands alone.
    """
    del mask
    ratio = torch.exp(logp - old_logp)  # [B, T]
    a = adv.unsqueeze(-1)  # [B, 1]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * a
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


@POLICY_LOSSES.register("gspo")
def gspo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Qwen, 2025) in its token form: every token carries the sequence ratio
    s_i = exp(mean_t log(π/π_old)), with gradient s_i ∇log π(y_t).

    One ratio per sequence is what keeps MoE training stable: a routing change that moves
    a single token's probability cannot clip or explode that token alone.
    """
    log_ratio = (logp - old_logp) * mask
    seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    # value s_i on every token, gradient through each token's own log-prob
    ratio = torch.exp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1))  # [B, T]
    a = adv.unsqueeze(-1)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * a
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log π - log π_ref: unbiased, high variance, can be negative per token."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π_ref - log π)²: biased, low variance, never negative."""
    return 0.5 * (ref_logp - logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = π_ref/π - 1 - log(π_ref/π): unbiased and non-negative (DeepSeekMath's choice)."""
    d = ref_logp - logp
    return torch.exp(d) - 1 - d


@dataclass(frozen=True)
class Totals:
    """Normalisers of the whole optimizer step (all micro-batches on all data-parallel ranks).

    Aggregating each micro-batch against the step's totals makes the summed gradients equal
    to the gradient of one big batch, whatever the micro-batch size or rank count.
    """

    tokens: float  # completion tokens in the step
    sequences: float  # completions in the step
    norm_len: float  # token-sum-norm's constant (maxNewTokens)


@AGGREGATIONS.register("token-mean")
def agg_token_mean(loss: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
    """Every token weighs the same (DAPO): long completions count more."""
    return (loss * mask).sum() / totals.tokens


@AGGREGATIONS.register("sequence-mean")
def agg_sequence_mean(loss: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
    """Every completion weighs the same (original GRPO): mean over tokens, then over sequences."""
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / totals.sequences


@AGGREGATIONS.register("token-sum-norm")
def agg_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, totals: Totals) -> torch.Tensor:
    """Dr. GRPO: token sum over a constant (sequences x maxNewTokens), so no length bias."""
    return (loss * mask).sum() / (totals.sequences * totals.norm_len)


@dataclass(frozen=True)
class LossConfig:
    """The loss-relevant part of AlgorithmSpec, validated against the registries."""

    policy_loss: str = "grpo"  # key of POLICY_LOSSES
    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: str = "token-mean"  # key of AGGREGATIONS
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # key of KL_ESTIMATORS
    entropy_coef: float = 0.0
    is_cap: float | None = 2.0  # truncated importance sampling cap; None disables it

    def __post_init__(self) -> None:
        for name, table in (
            (self.policy_loss, POLICY_LOSSES),
            (self.aggregation, AGGREGATIONS),
            (self.kl_estimator, KL_ESTIMATORS),
        ):
            table.get(name)  # a ValueError naming the kind and its choices

    @classmethod
    def from_spec(cls, algo: AlgorithmSpec) -> "LossConfig":
        return cls(
            policy_loss=str(algo.policy_loss),
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            aggregation=str(algo.loss_aggregation),
            kl_coef=algo.kl_coef,
            kl_estimator=str(algo.kl_estimator),
            entropy_coef=algo.entropy_coef,
            is_cap=algo.importance_sampling_cap if str(algo.importance_sampling) == "truncated" else None,
        )


def truncated_is_weight(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """TIS (Yao et al. 2025): min(π_old/π_rollout, cap), no gradient.

    The sampler (vLLM, bf16 kernels, maybe an older weight version) and the trainer disagree
    on log-probs; weighting by their ratio corrects the off-policy bias, the cap bounds variance.
    """
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


def grpo_loss(
    cfg: LossConfig,
    *,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    totals: Totals,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token policy loss x IS weight + β KL - α entropy, aggregated; plus masked-mean metrics."""
    fn = POLICY_LOSSES[cfg.policy_loss]
    per_token, clipped = fn(logp, old_logp, advantages, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    n = mask.sum().clamp(min=1)
    metrics = {"clip_frac": float((clipped * mask).sum() / n)}
    if cfg.is_cap is not None and rollout_logp is not None:
        w = truncated_is_weight(old_logp, rollout_logp, cfg.is_cap)
        per_token = per_token * w
        metrics["is_weight"] = float((w * mask).sum() / n)
    if cfg.kl_coef > 0 and ref_logp is not None:
        kl = KL_ESTIMATORS[cfg.kl_estimator](logp, ref_logp)
        per_token = per_token + cfg.kl_coef * kl
        metrics["kl"] = float((kl.detach() * mask).sum() / n)
    if cfg.entropy_coef > 0 and entropy is not None:
        per_token = per_token - cfg.entropy_coef * entropy
    if entropy is not None:
        metrics["entropy"] = float((entropy.detach() * mask).sum() / n)
    return AGGREGATIONS[cfg.aggregation](per_token, mask, totals), metrics


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] without materialising the full log-softmax twice: [B, T, V] → [B, T]."""
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's full distribution: [B, T, V] → [B, T]."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _chunk_stats(
    hidden: torch.Tensor, targets: torch.Tensor, head: Callable, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: hidden [C, H] → (log-prob of the target [C], entropy [C] or an empty tensor)."""
    logits = head(hidden).float() / temperature  # [C, V]: the only full-vocab tensor, one chunk's
    logp = token_logprobs(logits, targets)
    return logp, token_entropy(logits) if entropy else logp.new_empty(0)


def chunked_token_stats(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float,
    *,
    chunk_tokens: int,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` (and `token_entropy`) of `head(hidden) / temperature`, `chunk_tokens` tokens at
    a time: hidden [B, T, H] (the final norm's output), targets [B, T] → ([B, T], [B, T] or None).

    The full-vocabulary fp32 logits exist for one chunk at a time, in the forward and in the
    backward: each chunk is recomputed from its hidden rows there (`torch.utils.checkpoint`),
    so what stays saved is the [B, T, H] input and the [B, T] outputs. Same numbers as the
    unchunked functions (same formulas per row), gradients included.
    """
    b, t, h = hidden.shape
    rows, tgt = hidden.reshape(b * t, h), targets.reshape(b * t)  # [N, H], [N]
    grad = torch.is_grad_enabled() and hidden.requires_grad
    logps, ents = [], []
    for lo in range(0, b * t, chunk_tokens):
        args = (rows[lo : lo + chunk_tokens], tgt[lo : lo + chunk_tokens], head, temperature, entropy)
        lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False) if grad else _chunk_stats(*args)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps).reshape(b, t) if logps else rows.new_zeros(b, t, dtype=torch.float32)
    if not entropy:
        return logp, None
    return logp, torch.cat(ents).reshape(b, t) if ents else torch.zeros_like(logp)
