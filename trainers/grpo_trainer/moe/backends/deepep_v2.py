"""DeepEP v2 (`deep_ep.ElasticBuffer`, "EPv2") for EP groups across EFA nodes, over NCCL GIN.

The backend `deepep_v2`, always registered and an `auto` candidate; where `deep_ep.ElasticBuffer`
does not import, `requires` refuses it with the import's reason and building it by name raises
BackendUnavailable. Offered for groups that span nodes (inside one node v1 and `nccl` serve).
Run-time needs (see docs/deepep-efa.md): NCCL >= 2.31 with GIN, aws-ofi-nccl >= 1.21 as the NCCL
net and GIN plugin, GDRCopy's `gdrdrv`, and the pod env the renderer sets (`NCCL_GIN_TYPE`, never
IBGDA/GDAKI). Written against the upstream v2 API at the Dockerfile's DEEPEP_COMMIT, not yet run
here.

Sizes: the buffer holds `buffer_tokens(tokens, cap)` tokens per rank, the tokens one MoE layer
dispatches at once (the trainer passes a micro-batch's tokens) but at most the cap; a layer that
sees more is dispatched in chunks by `grpo_trainer.moe.deepep`. The SM and QP counts are resolved
once, always positive, and passed to every dispatch and combine: with `num_sms=0` v2 estimates them
per call, and a cached (backward) dispatch then calls `get_theoretical_num_sms(num_experts=None,
...)`, which raises TypeError.

Settings (pod env, the same on every rank):
- GRPO_DEEPEP_MAX_TOKENS: the cap on tokens per rank per dispatch (default 16384), which bounds the
  buffer's memory (it grows with tokens x hidden x nodes).
- GRPO_DEEPEP_NUM_SMS / GRPO_DEEPEP_NUM_QPS: SMs and QPs per dispatch/combine. v2 estimates them by
  parsing `ibstat` for mlx5 NICs, which EFA does not have, so on EFA (FI_PROVIDER=efa) both are
  given (`grpo_wire.efa`, shared with the rollout's vLLM): 12 SMs (the AWS launcher's value) and
  EFA_QPS queue pairs, which the buffer also allocates (`num_allocated_qps`; v2's automatic count
  is 129 in hybrid mode, `elastic.py:328-335` at DEEPEP_COMMIT). Elsewhere v2's own estimates, taken
  once, and v2's allocation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from grpo_wire import efa
from grpo_wire.deepep_import import import_deep_ep

from grpo_trainer.moe import collective_build
from grpo_trainer.moe.deepep import DeepEPDispatcher, check_communicator, release_exchanges
from grpo_trainer.moe.dispatch import register_backend
from grpo_trainer.moe.layout import Layout

NAME = "deepep_v2"
API = "deep_ep.ElasticBuffer"
MAX_LOCAL_EXPERTS = 256  # upstream's documented bound on experts per rank
DEFAULT_MAX_TOKENS = 16384
ElasticBuffer, WHY = import_deep_ep("ElasticBuffer")  # None and the reason on CPU images or a v1 build
AVAILABLE = ElasticBuffer is not None


def requires(layout: Layout, num_experts: int, buffer_cls: Any = None) -> str | None:
    """Why v2 should not serve this layout, or None."""
    if (buffer_cls or ElasticBuffer) is None:
        return WHY or "deep_ep.ElasticBuffer is not installed"
    if layout.device != "cuda":
        return "DeepEP needs CUDA GPUs"
    if not layout.spans_nodes:
        return "the EP group is inside one node: DeepEP v1 or nccl all-to-all serve it"
    if num_experts % layout.size:
        return f"{num_experts} experts do not divide over {layout.size} ranks"
    if num_experts // layout.size > MAX_LOCAL_EXPERTS:
        return f"{num_experts // layout.size} experts per rank; DeepEP v2 takes at most {MAX_LOCAL_EXPERTS}"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
        return "DeepEP v2 needs SM90 or newer"
    return gin_missing()


def gin_missing(env: dict[str, str] | None = None, facts: efa.NodeFacts | None = None) -> str | None:
    """What NCCL GIN lacks in this pod where it runs through aws-ofi-nccl (NCCL_GIN_PLUGIN=ofi, the
    renderer's on EFA), or None: without it v2 fails inside its constructor with NCCL's words."""
    env = dict(os.environ) if env is None else env
    if env.get("NCCL_GIN_PLUGIN") != "ofi":
        return None
    problems = efa.gin_problems(facts or efa.probe(env))
    return "NCCL GIN over EFA lacks: " + "; ".join(problems) if problems else None


def settings(env: dict[str, str] | None = None) -> tuple[int, int | None, int | None]:
    """(cap on tokens per rank per dispatch, SMs or None for v2's estimate, QPs or None)."""
    env = dict(os.environ) if env is None else env
    max_tokens = int(env.get("GRPO_DEEPEP_MAX_TOKENS", str(DEFAULT_MAX_TOKENS)))
    if max_tokens < 1:
        raise ValueError(f"GRPO_DEEPEP_MAX_TOKENS must be positive, got {max_tokens}")
    sms, qps = efa.deepep_counts(env)  # one place for the trainer and the rollout's vLLM
    return max_tokens, sms, qps


def allocated_qps(qps: int | None) -> int:
    """`ElasticBuffer(num_allocated_qps=...)`: the QPs every call uses when they are given (EFA), so the
    buffer does not allocate v2's automatic 129; 0 (v2 decides) otherwise."""
    if qps is not None and qps < 1:
        raise ValueError(f"GRPO_DEEPEP_NUM_QPS must be positive, got {qps}")
    return qps or 0


def buffer_tokens(tokens: int | None, cap: int) -> int:
    """Tokens per rank the buffer is sized for: what one dispatch carries (`tokens`, a layer's
    tokens; unknown: the cap), at most the cap (pure). Every rank must pass the same value."""
    return cap if tokens is None else max(1, min(tokens, cap))


def resolve_count(name: str, configured: int | None, estimate: Callable[[], int]) -> int:
    """A positive SM or QP count: the configured one, else v2's estimate, taken once (pure apart
    from `estimate`)."""
    count = configured if configured is not None else int(estimate())
    if count < 1:
        setting = f"GRPO_DEEPEP_NUM_{name.upper()}"
        raise ValueError(f"DeepEP v2 needs a positive {name} count ({setting}), got {count}")
    return count


def dispatch_kwargs(num_experts: int, max_tokens: int, num_sms: int, num_qps: int) -> dict[str, Any]:
    """Keyword arguments of a first `ElasticBuffer.dispatch` (exact receive counts: the one host
    sync the exchange needs)."""
    first = {"num_experts": num_experts, "num_max_tokens_per_rank": max_tokens, "do_cpu_sync": True}
    return first | combine_kwargs(num_sms, num_qps)


def cached_dispatch_kwargs(num_sms: int, num_qps: int) -> dict[str, Any]:
    """Keyword arguments of a dispatch with a cached handle (the backward of combine): the SM count
    must be given, as v2 would estimate it from `num_experts`, which a cached call leaves None."""
    return combine_kwargs(num_sms, num_qps)


def combine_kwargs(num_sms: int, num_qps: int) -> dict[str, Any]:
    """SM and QP counts of every call (positive: 0 asks v2 to estimate them, see the docstring)."""
    if num_sms < 1 or num_qps < 1:
        raise ValueError(f"DeepEP v2 calls need positive SM and QP counts, got {num_sms} and {num_qps}")
    return {"num_sms": num_sms, "num_qps": num_qps}


class V2Exchange:
    """One `ElasticBuffer` per (group, hidden, top-k, experts, tokens), sized by v2 from the MoE
    settings; freed by `destroy` (collective), not by the garbage collector."""

    def __init__(
        self, group: dist.ProcessGroup, hidden: int, top_k: int, num_experts: int, tokens: int | None
    ) -> None:
        cap, sms, qps = settings()
        self.max_tokens = buffer_tokens(tokens, cap)
        check_communicator(group)  # v2 reuses torch's communicator of the group
        self.buffer = ElasticBuffer(
            group,
            num_max_tokens_per_rank=self.max_tokens,
            hidden=hidden,
            num_topk=top_k,
            num_allocated_qps=allocated_qps(qps),
            explicitly_destroy=True,
        )
        self.num_experts = num_experts
        buffer = self.buffer
        self.num_sms = resolve_count("sms", sms, lambda: buffer.get_theoretical_num_sms(num_experts, top_k))
        self.num_qps = resolve_count("qps", qps, lambda: buffer.get_theoretical_num_qps(self.num_sms))

    def dispatch(self, x, topk_idx, topk_weights, num_experts):  # see deepep.Exchange
        if x.shape[0] > self.max_tokens:  # the dispatcher chunks: reaching this is a bug
            raise ValueError(f"{x.shape[0]} tokens on this rank > the DeepEP v2 buffer's {self.max_tokens}")
        kwargs = dispatch_kwargs(num_experts, self.max_tokens, self.num_sms, self.num_qps)
        recv_x, recv_idx, recv_weights, handle, _ = self.buffer.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, **kwargs
        )
        return recv_x, recv_idx, recv_weights, handle.num_recv_tokens_per_expert_list, handle

    def redispatch(self, x: torch.Tensor, handle: Any) -> torch.Tensor:
        return self.buffer.dispatch(x, handle=handle, **cached_dispatch_kwargs(self.num_sms, self.num_qps))[0]

    def combine(self, x, handle, topk_weights=None):
        combined, weights, _ = self.buffer.combine(
            x, handle, topk_weights=topk_weights, **combine_kwargs(self.num_sms, self.num_qps)
        )
        return combined, weights

    def destroy(self) -> None:
        self.buffer.destroy()


_EXCHANGES: dict[tuple[int, int, int, int, int | None], V2Exchange] = {}


@register_backend(NAME, requires=requires)
class Dispatcher(DeepEPDispatcher):
    """DeepEP v2 across nodes."""

    name = NAME
    unavailable = None if AVAILABLE else f"{API} does not import: {WHY}"

    def exchange(self, hidden: int, top_k: int) -> V2Exchange:
        key = (id(self.group), hidden, top_k, self.num_experts, self.tokens)
        if key not in _EXCHANGES:
            build = partial(V2Exchange, self.group, hidden, top_k, self.num_experts, self.tokens)
            _EXCHANGES[key] = collective_build.build(
                "DeepEP v2's ElasticBuffer", self.group, build
            )  # bounded, agreed
        return _EXCHANGES[key]

    def release(self) -> None:
        release_exchanges(_EXCHANGES, self.group)
