"""Reward shaping and group-relative advantages: the pure maths before the loss.

Called by the training loop (`grpo_trainer.loop`) once per step on the rewards that came
back from the rollout servers, in this order: `overlong_penalty` (shapes rewards),
`zero_variance_mask` (which groups carry signal), an estimator from `ADVANTAGES`
(rewards → advantages). Every function takes rewards shaped [prompts, group_size].
Adding an estimator is one function registered in `ADVANTAGES`, its value in the API enum and its test.
"""

from collections.abc import Callable

import torch
from grpo_wire.registry import Registry

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage normalization", home=__name__)

STD_EPS = 1e-4


@ADVANTAGES.register("group-std")
def group_std_advantages(rewards: torch.Tensor, eps: float = STD_EPS) -> torch.Tensor:
    """GRPO (DeepSeekMath): A_i = (r_i - mean_g) / (std_g + eps), unbiased std as TRL uses.

    Dividing by the std makes every group's advantages unit-scale, so easy and hard prompts
    pull equally hard; `eps` keeps zero-variance groups at exactly 0 instead of NaN.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True)
    return (rewards - mean) / (std + eps)


@ADVANTAGES.register("group-mean")
def group_mean_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: A_i = r_i - mean_g. No std, so low-variance (too easy/hard) groups are not inflated."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def zero_variance_mask(rewards: torch.Tensor) -> torch.Tensor:
    """True for groups whose rewards differ (DAPO dynamic sampling): [prompts, G] → [prompts].

    A group where every completion scored the same has zero advantage everywhere; training
    on it costs compute and, with token-mean aggregation, dilutes the other groups' gradient.
    """
    return rewards.amax(dim=-1) > rewards.amin(dim=-1)


def overlong_penalty(
    rewards: torch.Tensor, lengths: torch.Tensor, *, max_new_tokens: int, buffer_tokens: int, penalty: float
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the rewards.

    Lengths up to max_new_tokens - buffer_tokens cost nothing; inside the buffer the cost
    grows linearly to `penalty` at the limit (and stays there beyond it), so the policy
    learns to finish before truncation instead of being hit by a cliff.
    """
    free = max_new_tokens - buffer_tokens
    over = (lengths.to(rewards.dtype) - free).clamp(min=0, max=buffer_tokens)
    return rewards - penalty * over / buffer_tokens
