"""The `auto` EP backend: one measured choice for the whole gang that never crashes the start-up.

The backend `auto` (`grpo_trainer.moe.backends.auto`); `expert_parallel(..., backend="auto")` ends
up here when the EP group has more than one rank. Steps, run by every rank of the world in the same
order (the collectives below are over the WORLD, so all EP groups end up on one backend):

1. Candidates: every registered backend with a `requires` (`register_backend(name, requires)`) in
   a fixed order, the all-to-all backends (`nccl`, `gloo`) first. Each one's `requires(layout)`
   says why it cannot work on this rank's layout (device, EP group inside one node or across
   nodes, installed library and why it does not import); a candidate refused on any rank is
   skipped everywhere (one all-reduce of a 0/1 vector).
2. For each remaining candidate: build it for the tokens one dispatch carries (guarded),
   all-reduce "built everywhere"; time a few dispatch+combine round trips with the model's real
   shapes, as many tokens as a micro-batch (guarded), all-reduce the slowest rank's time (MAX; a
   rank that failed reports +inf). A candidate that failed on any rank is excluded everywhere and
   its buffers freed; the reasons of all ranks are gathered, logged and kept.
3. The fastest remaining candidate wins, the others' buffers are freed; the all-to-all of the
   group's own device is always a candidate, so the fallback exists. `Selection` says what was
   chosen and why (each candidate's time, or why it was skipped or failed): the start-up log
   line and the step report's `ep_backend`/`ep_candidates`, which become the job's `status.progress`.

A backend that fails on some ranks *inside* a collective constructor (DeepEP's buffers) cannot be
dropped like this: its peers are blocked there. `collective_build` bounds that case: every rank
ends its process with all ranks' verdicts within its timeout (see there).
On EFA, NCCL all-to-all often beats DeepEP at small EP, which is why
this is measured rather than assumed.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from grpo_trainer.moe.dispatch import BACKENDS, Dispatcher, make_dispatcher
from grpo_trainer.moe.layout import Layout, layout_of

log = logging.getLogger(__name__)
FAILURES: Counter[str] = Counter()
"""grpo_ep_backend_failures_total{backend}: candidates that failed to build or to round-trip."""


@dataclass(frozen=True)
class EPShape:
    """The shapes the measurement uses: the model's, so the choice holds for training."""

    hidden: int = 1024
    """Hidden size of the tokens moved."""
    top_k: int = 4
    """Experts per token."""
    tokens: int = 1024
    """Tokens one MoE layer dispatches at once on one rank (a micro-batch: sequences x their
    length); DeepEP buffers are sized for it (`make_dispatcher(..., tokens)`)."""

    def __post_init__(self) -> None:
        if min(self.hidden, self.top_k, self.tokens) < 1:
            raise ValueError(f"EPShape needs positive sizes, got {self}")


FIRST = ("nccl", "gloo")
"""Measured first: the all-to-all that works wherever the experts divide over the ranks."""


def candidate_names() -> list[str]:
    """Every backend `auto` may measure, in measuring order (the same list on every rank)."""
    names = [name for name, backend in BACKENDS.items() if backend.requires is not None]
    return sorted(names, key=lambda n: (n not in FIRST, n))


def candidates(layout: Layout, num_experts: int) -> tuple[list[str], dict[str, str]]:
    """Pure: (candidate names in measuring order, {name: why it was refused}) for one layout."""
    names = candidate_names()
    requires = {n: BACKENDS.get(n).requires for n in names}
    refused = {n: reason for n in names if (reason := requires[n](layout, num_experts))}  # type: ignore[misc]
    return [n for n in names if n not in refused], refused


@dataclass
class Selection:
    """What `auto` chose and why: the report's `epBackend` and its start-up log line."""

    backend: str
    seconds: dict[str, float] = field(default_factory=dict)
    """Slowest rank's seconds per round trip of each measured candidate."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Why each candidate refused by layout or library (on some rank) was not measured."""
    failures: dict[str, str] = field(default_factory=dict)
    """Why each candidate that failed to build or to round-trip (on some rank) was not chosen."""

    def summary(self) -> dict[str, str]:
        out = {n: f"{s * 1e3:.3f} ms" for n, s in self.seconds.items()}
        out |= {n: f"skipped: {r}" for n, r in self.skipped.items()}
        return out | {n: f"failed: {r}" for n, r in self.failures.items()}


def round_trip_seconds(
    dispatcher: Dispatcher, shape: EPShape, num_experts: int, device: str, iters: int = 3
) -> float:
    """This rank's seconds per dispatch+combine of random routing with `shape` (no world collective)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(shape.tokens, shape.hidden, device=dev, dtype=dtype)
    idx = torch.rand(shape.tokens, num_experts, device=dev).topk(min(shape.top_k, num_experts), dim=1)[1]
    weights = torch.full(idx.shape, 1.0 / idx.shape[1], device=dev)
    with torch.no_grad():
        for i in range(iters + 1):  # the first is a warm-up: buffers, connections
            if i == 1:
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            sent = dispatcher.dispatch(x, idx, weights)
            dispatcher.combine(sent.rows, sent.handle)
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _world_reduce(values: list[float], op: dist.ReduceOp, device: str) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if device == "cuda" else "cpu")
    dist.all_reduce(t, op=op)
    return t.tolist()


def _reasons(local: str | None) -> str:
    """Collective over the world: the failure reasons of all ranks, as one line."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return "; ".join(f"rank {r}: {why}" for r, why in enumerate(gathered) if why)


def _fail(name: str, why: str, failures: dict[str, str]) -> None:
    FAILURES[name] += 1
    failures[name] = why
    log.warning("EP backend %s failed, not chosen: %s", name, why)


def _release(dispatcher: object) -> None:
    """Free what a candidate holds (DeepEP buffers); every rank calls it at the same point."""
    if hasattr(dispatcher, "release"):
        dispatcher.release()


def _try(name: str, step: Callable[[], object]) -> tuple[object, str | None]:
    try:
        return step(), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def choose_backend(
    group: dist.ProcessGroup | None,
    num_experts: int,
    shape: EPShape | None = None,
    ranks_per_node: int | None = None,
) -> tuple[Dispatcher, Selection]:
    """Collective over the WORLD: the dispatcher every EP group uses, and the selection record."""
    shape = shape or EPShape()
    layout = layout_of(group, ranks_per_node)
    names = candidate_names()
    mine, refused = candidates(layout, num_experts)
    agreed = _world_reduce([float(n in mine) for n in names], dist.ReduceOp.MIN, layout.device)
    selection = Selection(backend="")
    for name, ok in zip(names, agreed, strict=True):
        if not ok:  # refused on some rank: every rank skips it, with the reasons of all ranks
            selection.skipped[name] = _reasons(refused.get(name))
            log.info("EP backend %s skipped: %s", name, selection.skipped[name])
    built: dict[str, Dispatcher] = {}
    for name in (n for n, ok in zip(names, agreed, strict=True) if ok):
        dispatcher, why = _try(name, partial(make_dispatcher, name, group, num_experts, shape.tokens))
        (built_everywhere,) = _world_reduce([float(why is None)], dist.ReduceOp.MIN, layout.device)
        if not built_everywhere:  # no round trip: a rank whose peer has no dispatcher would hang
            # nor a release: DeepEP frees a buffer collectively, and some rank has none to free
            _fail(name, _reasons(why), selection.failures)
            continue
        timed, why = _try(name, lambda d=dispatcher: round_trip_seconds(d, shape, num_experts, layout.device))
        (slowest,) = _world_reduce([timed if why is None else math.inf], dist.ReduceOp.MAX, layout.device)
        if math.isinf(slowest):
            _release(dispatcher)  # e.g. a DeepEP buffer built before its round trip failed
            _fail(name, _reasons(why), selection.failures)
            continue
        built[name] = dispatcher  # type: ignore[assignment]
        selection.seconds[name] = slowest
    if not built:
        raise RuntimeError(f"no EP backend works here: {selection.failures}")
    selection.backend = min(selection.seconds, key=selection.seconds.__getitem__)
    for name, loser in built.items():  # e.g. DeepEP buffers: GPU memory the chosen one may need
        if name != selection.backend:
            _release(loser)
    best = built[selection.backend]
    best.bytes_sent = 0
    best.clock.take()  # the measurement is not training time
    log.info(
        "EP backend: %s chosen for the gang, the fastest round trip of %d tokens per rank (hidden %d, "
        "top-%d); candidates %s",
        selection.backend,
        shape.tokens,
        shape.hidden,
        shape.top_k,
        selection.summary(),
    )
    return best, selection


_CHOSEN: dict[tuple[int, int, EPShape], Selection] = {}
"""Decisions already taken (the reference model and later layers reuse them: no re-measuring)."""


def auto_dispatcher(
    group: dist.ProcessGroup | None,
    num_experts: int,
    shape: EPShape | None = None,
    ranks_per_node: int | None = None,
    tokens: int | None = None,
) -> Dispatcher:
    """`local` for one rank, otherwise the gang's measured choice (see `choose_backend`);
    `tokens` (per dispatch) stands in for `shape` when only that is known (`make_dispatcher`)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return make_dispatcher("local", None, num_experts)
    shape = shape or (EPShape(tokens=tokens) if tokens else EPShape())
    key = (dist.get_world_size(group), num_experts, shape)
    if key in _CHOSEN:
        dispatcher = make_dispatcher(_CHOSEN[key].backend, group, num_experts, shape.tokens)
    else:
        dispatcher, _CHOSEN[key] = choose_backend(group, num_experts, shape, ranks_per_node)
    dispatcher.selection = _CHOSEN[key]  # type: ignore[attr-defined]
    return dispatcher


def last_selection() -> Selection | None:
    """The latest `auto` decision of this process (for the step report), or None."""
    return next(reversed(_CHOSEN.values()), None)
