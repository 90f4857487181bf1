"""Top-k router of an MoE block: scores, expert choice, routing weights and the balancing loss.

Called by `grpo_trainer.moe.layer.MoELayer` once per forward. It reproduces the routers of
Qwen2/Qwen3-MoE and Mixtral (softmax, then top-k, optionally renormalised) and of DeepSeek-V3
(sigmoid, a score-correction bias that affects the choice only, group-limited top-k, a
routed scaling factor), so that an HF model keeps its numerics after `expert_parallel`.
Given expert choices (routing replay) bypass the choice but keep the weights differentiable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RouterConfig:
    """Routing rule of one MoE block."""

    num_experts: int
    """Routed experts of the block (all ranks together)."""
    top_k: int
    """Experts per token; 1 <= top_k <= num_experts."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """softmax (Qwen, Mixtral) or sigmoid (DeepSeek-V3) over the router logits."""
    norm_topk_prob: bool = True
    """Renormalise the chosen top-k scores to sum to one."""
    num_groups: int = 1
    """Expert groups for group-limited routing (DeepSeek-V3 `n_group`); 1 disables it."""
    topk_groups: int = 1
    """Groups a token may pick experts from (DeepSeek-V3 `topk_group`)."""
    scaling_factor: float = 1.0
    """Multiplier on the routing weights (DeepSeek-V3 `routed_scaling_factor`)."""
    score_bias: bool = False
    """Keep an `e_score_correction_bias` buffer added to scores for the choice only."""
    aux_loss_coef: float = 0.0
    """Weight of the Switch-style load-balancing loss; 0 computes none."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.num_groups:
            raise ValueError(f"num_experts={self.num_experts} not divisible by num_groups={self.num_groups}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_groups={self.topk_groups} must be in [1, num_groups={self.num_groups}]")
        if self.aux_loss_coef < 0:
            raise ValueError("aux_loss_coef must be >= 0")


def load_balancing_loss(probs: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer balancing loss, E * sum_e f_e * P_e (as HF's `load_balancing_loss_func`).

    f_e is the share of (token, slot) choices that went to expert e, P_e the mean score of e.
    It is 1 for perfectly uniform routing and grows as routing concentrates.
    """
    if topk_idx.numel() == 0:
        return probs.sum() * 0.0
    chosen = torch.zeros_like(probs).scatter_(1, topk_idx, 1.0)  # (T, E)
    share = chosen.mean(0) / topk_idx.shape[1]
    return num_experts * (share * probs.mean(0)).sum()


def spread_unrecorded(given_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A replayed choice (T, K) with -1 where none was recorded (padding, a row's last token) →
    int64 ids where those slots get K distinct experts that rotate with the token's position, so
    padding spreads over all experts (and EP ranks) instead of piling onto experts 0..K-1."""
    idx = given_idx.to(torch.int64)
    tokens, k = idx.shape
    spread = torch.arange(tokens, device=idx.device)[:, None] * k + torch.arange(k, device=idx.device)
    return torch.where(idx < 0, spread % num_experts, idx)


class Router(nn.Module):
    """Linear scores over the experts, then the choice and the weights of the top-k.

    `weight` has the HF layout (num_experts, hidden) so checkpoints load unchanged.
    After a training forward with `aux_loss_coef > 0`, `aux_loss` holds the scaled loss.
    """

    def __init__(self, config: RouterConfig, hidden_size: int, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.config = config
        if weight is None:
            weight = nn.Parameter(torch.empty(config.num_experts, hidden_size))
            nn.init.normal_(weight, std=0.02)
        if tuple(weight.shape) != (config.num_experts, hidden_size):
            raise ValueError(f"router weight {tuple(weight.shape)} != {(config.num_experts, hidden_size)}")
        self.weight = weight
        if config.score_bias:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(config.num_experts, dtype=torch.float32))
        self.aux_loss: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, given_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, H) → logits (T, E), topk_weights (T, K), topk_idx (T, K) int64.

        `given_idx` (T, K) replays a recorded choice: the weights are still computed from
        this model's scores at those experts, so gradients reach the router.
        """
        cfg = self.config
        logits = F.linear(x.to(self.weight.dtype), self.weight)
        if cfg.score_func == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = logits.float().sigmoid()
        idx = self._choose(scores) if given_idx is None else spread_unrecorded(given_idx, cfg.num_experts)
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = (weights * cfg.scaling_factor).to(x.dtype)
        if cfg.aux_loss_coef > 0 and self.training:
            self.aux_loss = cfg.aux_loss_coef * load_balancing_loss(scores, idx, cfg.num_experts)
        return logits, weights, idx

    @torch.no_grad()
    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids, limited to the best `topk_groups` groups when grouping is on."""
        cfg = self.config
        choice = scores + self.e_score_correction_bias if cfg.score_bias else scores
        if cfg.num_groups > 1:
            grouped = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
            # DeepSeek-V3 ranks a group by the sum of its two best scores.
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores)
            keep.scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1, sorted=False)[1], 1.0)
            mask = keep.unsqueeze(-1).expand_as(grouped).reshape(-1, cfg.num_experts).bool()
            choice = choice.masked_fill(~mask, float("-inf"))
        return choice.topk(cfg.top_k, dim=-1, sorted=False)[1]
