"""Packed micro-batches (`maxTokensPerMicroBatch`): the same log-probs and gradients as padded ones.

The real tiny Qwen3-MoE (SDPA attention, as the trainer runs it on CPU) sees sequences of
different lengths end to end in one row with restarting position ids; Hugging Face turns those
into block-diagonal causal attention. Were a sequence to attend across its start, or its
positions to continue from the previous one, its log-probs would differ from the padded batch's.
"""

import pytest
import torch
from grpo_trainer.batch import Rollouts, collate, pack
from grpo_trainer.forward import batch_logp
from grpo_trainer.tiny_model import TinyConfig, build_model, build_tokenizer


def rollouts() -> Rollouts:
    gen = torch.Generator().manual_seed(0)
    r = Rollouts(2, [], [], [], [], weight_version=0)
    for n_prompt, n_completion in ((3, 1), (3, 7), (5, 2), (5, 4)):
        r.prompt_tokens.append(torch.randint(3, 20, (n_prompt,), generator=gen).tolist())
        r.completion_tokens.append(torch.randint(3, 20, (n_completion,), generator=gen).tolist())
        r.rollout_logprobs.append([-1.0] * n_completion)
        r.rewards.append(0.0)
    return r


@pytest.mark.slow  # ≈3.4 s on the shared 2-core machine (the model's first forward and backward)
def test_packed_log_probs_and_gradients_equal_padded_ones() -> None:
    model = build_model(TinyConfig(experts=4), build_tokenizer()).float()
    r, adv = rollouts(), torch.tensor([1.0, -1.0, 0.5, -0.5])
    grads = []
    for build in (collate, pack):
        mb = build(r, [0, 1, 2, 3], adv, 0)
        model.zero_grad()
        logp, ent = batch_logp(model, mb, 1.0, entropy=True)  # [4, L-1] either way
        (logp * mb.mask * mb.advantages.unsqueeze(-1)).sum().backward()
        grads.append((logp * mb.mask, ent * mb.mask, [p.grad.clone() for p in model.parameters()]))
    (padded, ent_padded, g_padded), (packed, ent_packed, g_packed) = grads
    assert pack(r, [0, 1, 2, 3], adv, 0).input_ids.shape == (1, 30)  # 4 + 10 + 7 + 9 tokens, no padding
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_packed, ent_padded, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_packed, g_padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
