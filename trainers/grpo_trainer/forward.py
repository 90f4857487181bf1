"""The policy's forward as GRPO needs it: per-token log-probs (and entropy) of given sequences.

The loop, evaluation and tests call `batch_logp`/`forward_logp`; model code stays HF's. The head
and log-softmax run in chunks of `LOGITS_CHUNK_TOKENS` tokens so the full-vocab logits never exist
at once; `grpo_operator.memory_plan` plans with the same number (tests/unit/test_mirrors.py).
"""

import contextlib
import types

import torch
from torch import nn

from grpo_trainer.batch import MicroBatch
from grpo_trainer.losses import chunked_token_stats

LOGITS_CHUNK_TOKENS = 1024  # tokens per log-prob chunk


def autocast(device: torch.device, dtype_name: str) -> contextlib.AbstractContextManager:
    """GPU: compute in the spec's dtype (`model.dtype`, bf16) over float32 master weights. CPU:
    float32 throughout."""
    dtype = getattr(torch, str(dtype_name))
    enabled = device.type == "cuda" and dtype != torch.float32
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=enabled)


@contextlib.contextmanager
def _forward_as(model: nn.Module, fn) -> contextlib.AbstractContextManager:
    """Run `fn` as `model`'s forward inside the block: `model(...)` keeps its hooks (FSDP2's root
    unshard/reshard and gradient finalisation), so the head can be applied outside HF's forward."""
    model.forward = types.MethodType(fn, model)
    try:
        yield
    finally:
        del model.forward


def forward_logp(
    model: nn.Module,
    ids: torch.Tensor,
    temperature: float,
    *,
    entropy: bool = False,
    chunk_tokens: int = LOGITS_CHUNK_TOKENS,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of each next token under `model` at the sampling temperature, and the entropy of
    each position when asked: [b, L] → ([b, L-1], [b, L-1] or None).

    The decoder (final norm included) runs once; the head and log-softmax then run per chunk of
    `chunk_tokens` tokens (`chunked_token_stats`), so the full-vocab logits never exist at once.
    `position_ids` that restart mark packed sequences: attention stays within each."""

    def run(
        self: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        decoder = self.get_decoder()
        out = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state  # [b, L, H]
        logp, ent = chunked_token_stats(
            hidden[:, :-1],
            self.get_output_embeddings(),
            input_ids[:, 1:],
            temperature,
            chunk_tokens=chunk_tokens,
            entropy=entropy,
        )
        # [b, L-1] each, returned as fresh tensors: FSDP2 hooks the root's outputs and warns on views
        return logp.clone(), ent.clone() if ent is not None else None

    with _forward_as(model, run):
        return model(ids, position_ids)


def batch_logp(
    model: nn.Module, mb: MicroBatch, temperature: float, *, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`forward_logp` of a micro-batch, padded or packed, in the padded [b, L-1] layout."""
    logp, ent = forward_logp(model, mb.input_ids, temperature, entropy=entropy, position_ids=mb.position_ids)
    return mb.padded(logp), None if ent is None else mb.padded(ent)


def packs(model: nn.Module) -> bool:
    """Whether token-budget micro-batches are packed end to end (else length-sorted padded rows):
    flash-attention takes the sequence boundaries from the position ids (varlen) and skips
    attention across them; SDPA and eager would compute the whole row's attention under a
    block-diagonal mask, quadratic in the row's length, which costs more than the padding saved."""
    return str(getattr(model.config, "_attn_implementation", "")).startswith("flash")
