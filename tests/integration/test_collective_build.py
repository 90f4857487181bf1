"""A collective constructor that fails on some ranks stops the gang within its bound, with every
rank's verdict, instead of leaving the others in its barrier until the process group's timeout
(grpo_trainer.moe.collective_build, which DeepEP's buffers are built through).

Three real processes in a gloo world; the "constructor" ends in a rendezvous on the default
store that waits 600 s (as good as forever here), where one that raises first leaves its peers
blocked, as DeepEP's ElasticBuffer does with its closing barrier over NCCL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from grpo_trainer.moe.collective_build import EXIT_STUCK, stuck_message

from tests.support.ports import free_port

RANK = textwrap.dedent(
    """
    import datetime, sys
    import torch.distributed as dist
    from grpo_trainer.moe import collective_build

    rank, world, port, scenario = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))

    store = dist.distributed_c10d._get_default_store()

    def construct():
        if scenario == "all fail" or (scenario == "one fails" and rank == 1):
            raise RuntimeError(f"NCCL GIN is unavailable on rank {rank}")
        # the constructor's collective, one that nothing ends from outside (an NCCL barrier; gloo's
        # would end when a peer's process does): a rank that raised never arrives
        if store.add("arrived", 1) == world:
            store.set("everyone", "1")
        store.wait(["everyone"], datetime.timedelta(seconds=600))
        return "buffer"

    try:
        print("BUILT", collective_build.build("DeepEP v2's ElasticBuffer", None, construct, timeout_s=8))
    except RuntimeError as e:
        print("RAISED", e)
    """
)


def gang(scenario: str, world: int = 3) -> list[tuple[int, str, str]]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(world), str(port), scenario],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)  # a gang left in its barrier would hit this
        out.append((p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_a_rank_failing_inside_stops_every_rank_with_its_reason_within_the_bound():
    ranks = gang("one fails")
    assert [code for code, _, _ in ranks] == [EXIT_STUCK] * 3, ranks
    for _, _, stderr in ranks:
        assert "rank 1 failed: RuntimeError: NCCL GIN is unavailable on rank 1" in stderr, stderr[-2000:]
        assert "still inside it" in stderr and "DeepEP v2's ElasticBuffer" in stderr


@pytest.mark.slow
def test_a_failure_on_every_rank_is_raised_everywhere_and_nobody_is_stopped():
    """All ranks returned (no one blocked): the error is the caller's, as `auto` expects."""
    ranks = gang("all fail")
    assert [code for code, _, _ in ranks] == [0, 0, 0], ranks
    assert [out.split(" on rank")[0] for _, out, _ in ranks] == ["RAISED NCCL GIN is unavailable"] * 3


@pytest.mark.slow
def test_a_build_that_works_everywhere_returns_its_object():
    assert [(code, out.strip()) for code, out, _ in gang("all work")] == [(0, "BUILT buffer")] * 3


def test_the_message_names_who_failed_and_who_is_still_inside():
    said = {1: "failed: RuntimeError: no GIN", 2: "done"}
    text = stuck_message("DeepEP v2's ElasticBuffer", [0, 1, 2, 3], said, 120)
    assert "within 120s" in text and "rank 1 failed: RuntimeError: no GIN" in text
    assert "ranks [0, 3] still inside it" in text and "rank 2" not in text
