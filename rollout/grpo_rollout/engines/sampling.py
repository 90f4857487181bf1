"""Pure sampling maths of the torch engine: the sampling policy's log-probs and one sampling step.

Kept apart from the decode loop so the definition of "log-prob under the sampling policy" (see
`grpo_wire.protocol.Completion.logprobs`) lives in one small function the tests can read.
"""

import torch


def policy_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution tokens are drawn from: softmax(logits / T) cut to the top-p nucleus.

    logits: [B, V] -> [B, V] float32; tokens outside the nucleus get -inf, the rest are renormalised.
    The smallest set of most likely tokens whose mass reaches top_p is kept (always at least one).
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] mass of strictly more likely tokens
    sorted_logp = sorted_logp.masked_fill(mass_before >= top_p, float("-inf"))
    kept = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
    return torch.log_softmax(kept, dim=-1)


def sample_step(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens [B], their log-probs [B]) under the sampling policy
    (temperature 0: the most likely token, deterministically)."""
    if temperature == 0:  # greedy: the argmax, with its log-prob at temperature 1 (the protocol's rule)
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = logp.argmax(dim=-1, keepdim=True)  # [B, 1]
        return tokens.squeeze(1), logp.gather(1, tokens).squeeze(1)
    logp = policy_logprobs(logits, temperature, top_p)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)  # [B, 1]
    return tokens.squeeze(1), logp.gather(1, tokens).squeeze(1)
