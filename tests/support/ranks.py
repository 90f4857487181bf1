"""Start a test's gang of ranks from a forkserver that imported torch once.

Spawning a rank costs about 4 s of imports here (torch, transformers, the trainer) and the gang
tests start over a hundred ranks: with `spawn` that was most of their time. The forkserver
imports those modules once per session and forks each rank from itself, so a rank starts in
milliseconds and is still a fresh process (nothing of pytest's state, no threads). A forked
rank sees the environment the forkserver started with, so what ranks need is set here first.
"""

import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "transformers",
    "deepspeed.ops.adam",
    "grpo_trainer.loop",
    "grpo_trainer.parallel",
    "grpo_trainer.checkpoint",
    "grpo_operator.render",
]
ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache/grpo-operator/torch_extensions"),
}


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` processes; returns when all exited, raises if one failed."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
