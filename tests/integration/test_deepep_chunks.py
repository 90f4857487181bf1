"""DeepEP chunk counts agree over a real gloo EP group when ranks hold different token counts.

Every rank of an EP group must run as many DeepEP dispatches per layer (each is collective), so a
rank with few tokens still dispatches as many chunks as the busiest rank needs.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.distributed as dist

from tests.support.ranks import start_ranks

TOKENS = [3, 9]  # per rank; a buffer of 4 tokens: the busiest rank needs 3 chunks


def worker(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        from grpo_trainer.moe.deepep import DeepEPDispatcher

        dispatcher = DeepEPDispatcher(dist.group.WORLD, 8)
        assert dispatcher._chunks(TOKENS[rank], 4) == 3
        assert dispatcher._chunks(TOKENS[rank], None) == 1  # v1: no cap, no collective
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_rank_dispatches_as_many_chunks_as_the_busiest_needs() -> None:
    with tempfile.TemporaryDirectory() as folder:
        start_ranks(worker, (2, os.path.join(folder, "store")), 2)
