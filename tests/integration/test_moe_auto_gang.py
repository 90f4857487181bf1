"""`auto` over real gloo groups: one choice for the whole gang, failures skipped with reasons.

World 4, EP groups {0,1} and {2,3}, two ranks per "node". Test-only candidates, registered in
every rank the same way:
- `init_fails`: its constructor raises on world rank 3 only;
- `trip_raises`: builds everywhere, its round trip raises on world rank 1 only, and it would
  be the fastest (no communication at all) if it counted; it must be released;
- `refused_there`: refused by layout for the second EP group only;
- `slow_released`: works but loses, and must be released.
Every rank must end on `gloo`, with each failure's reason (naming the failing rank) in the
selection, and nobody hangs (the spawn joins under the test's timeout).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import start_ranks


class _Moveless:
    """Moves nothing: fast, and wrong as EP, which is fine for a candidate that must lose."""

    name = "moveless"

    def __init__(self, group, num_experts: int, tokens: int | None = None) -> None:
        from grpo_trainer.moe.dispatch import ExchangeClock

        self.bytes_sent, self.clock = 0, ExchangeClock()

    def dispatch(self, x, topk_idx, topk_weights):
        from grpo_trainer.moe.dispatch import Dispatched

        return Dispatched(x, [x.shape[0]], topk_weights[:, 0], None)

    def combine(self, rows, handle):
        return rows


class _NoExchange(_Moveless):
    name = "trip_raises"
    released = False

    def dispatch(self, x, topk_idx, topk_weights):
        if dist.get_rank() == 1:
            raise RuntimeError("round trip broke on purpose")
        return super().dispatch(x, topk_idx, topk_weights)

    def release(self) -> None:
        _NoExchange.released = True


class _SlowReleased(_Moveless):
    """Works everywhere but loses (slow); must be told to release what it holds."""

    name = "slow_released"
    released = False

    def dispatch(self, x, topk_idx, topk_weights):
        time.sleep(0.05)
        return super().dispatch(x, topk_idx, topk_weights)

    def release(self) -> None:
        _SlowReleased.released = True


def _init_fails(group, num_experts: int, tokens: int | None = None):
    if dist.get_rank() == 3:
        raise RuntimeError("init broke on purpose")
    return _NoExchange(group, num_experts)


def worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from grpo_trainer.moe import autoselect, dispatch

        def anywhere(layout, n):
            return None

        dispatch.register_backend("init_fails", requires=anywhere)(_init_fails)
        dispatch.register_backend("trip_raises", requires=anywhere)(_NoExchange)
        dispatch.register_backend("slow_released", requires=anywhere)(_SlowReleased)
        dispatch.register_backend(
            "refused_there", requires=lambda layout, n: "second group" if layout.ranks[0] == 2 else None
        )(_NoExchange)
        ep = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        shape = autoselect.EPShape(hidden=16, top_k=2, tokens=32)
        dispatcher = autoselect.auto_dispatcher(ep, 8, shape, ranks_per_node=2)
        selection = dispatcher.selection
        assert dispatcher.name == "gloo" and selection.backend == "gloo"
        assert "rank 3: RuntimeError: init broke on purpose" in selection.failures["init_fails"]
        assert "rank 1: RuntimeError: round trip broke on purpose" in selection.failures["trip_raises"]
        assert "rank 2: second group" in selection.skipped["refused_there"]
        assert "refused_there" not in selection.failures  # refused by layout: no failure Event
        assert set(selection.seconds) == {"gloo", "slow_released"}
        assert selection.seconds["slow_released"] > selection.seconds["gloo"]
        assert _SlowReleased.released  # the losers' buffers are dropped on every rank
        assert _NoExchange.released  # and so are those of a candidate whose round trip failed
        assert autoselect.FAILURES["init_fails"] == autoselect.FAILURES["trip_raises"] == 1
        assert dispatcher.bytes_sent == 0 and dispatcher.clock.take() == 0.0
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (selection.backend, sorted(selection.failures)))
        assert all(e == everyone[0] for e in everyone)  # the whole gang agrees
        # the same decision is reused (no second measurement) for another model of the same shapes
        again = autoselect.auto_dispatcher(ep, 8, shape, ranks_per_node=2)
        assert again.name == "gloo" and autoselect.FAILURES["init_fails"] == 1
        # and the chosen backend really moves tokens: x through identity experts comes back x
        x = torch.randn(6, 16)
        idx = torch.stack([torch.randperm(8)[:2] for _ in range(6)])
        sent = dispatcher.dispatch(x, idx, torch.full((6, 2), 0.5))
        torch.testing.assert_close(dispatcher.combine(sent.rows * sent.weights[:, None], sent.handle), x)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_skips_failing_candidates_and_the_gang_agrees() -> None:
    with tempfile.TemporaryDirectory() as folder:
        start_ranks(worker, (4, os.path.join(folder, "store")), 4)
