"""Checkpoints of the trainer gang: weights, optimizer, RNG, step, weight version, data position.

Called by the training loop every `checkpoint.everySteps` steps and once at start-up (resume).
Layout under the contract's checkpointDir (shared storage in a cluster):

    step-00000010/rank-00000.pt ...   each rank's model shard, optimizer state and RNG
    step-00000010/meta.json           TrainState + the spec that made it; written last
    final/                            the trained policy in Hugging Face format (end of training)

A save is written into `step-N.tmp/` and renamed once every rank has finished and meta.json is
on disk, so a crash mid-save leaves no directory that `latest` would pick. Older saves beyond
`keepLast` are removed after the rename. Resuming needs the same world size and EP size
(both immutable fields of a GRPOJob).
"""

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from grpo_trainer.config import ConfigError, RankInfo


class Stateful(Protocol):
    """An optimizer as checkpoints see it (torch optimizers and `grpo_trainer.optim.GangAdamW`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


STEP_DIR = re.compile(r"^step-(\d{8})$")
META = "meta.json"


@dataclass
class TrainState:
    """The loop's counters: everything besides tensors that a resumed run must continue from."""

    step: int = 0  # optimizer steps completed
    version: int = 0  # weight version of the current policy (rollout servers run <= this)
    position: int = 0  # global dataset position of the first prompt not trained on yet


def _rank_file(d: Path, rank: int) -> Path:
    return d / f"rank-{rank:05d}.pt"


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest(root: str | Path) -> Path | None:
    """The newest complete save under `root`, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    done = [d for d in root.iterdir() if STEP_DIR.match(d.name) and (d / META).is_file()]
    return max(done, key=lambda d: d.name, default=None)


def save(
    root: str | Path,
    state: TrainState,
    model: nn.Module,
    optimizer: Stateful,
    info: RankInfo,
    *,
    keep_last: int,
    spec: dict[str, Any],
) -> Path:
    """Collective: every rank writes its file, rank 0 seals the save. Returns the final path."""
    root = Path(root)
    final = root / f"step-{state.step:08d}"
    tmp = final.with_name(final.name + ".tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    blob = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": _rng_state()}
    part = _rank_file(tmp, info.rank).with_suffix(".part")
    torch.save(blob, part)
    os.replace(part, _rank_file(tmp, info.rank))
    dist.barrier()
    if info.is_main:
        meta = {"state": asdict(state), "world_size": info.world_size, "ep_size": info.ep_size, "spec": spec}
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(root, keep_last)
    dist.barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` saves; drop unfinished `.tmp` saves of crashed runs too."""
    saves = sorted(d for d in root.iterdir() if STEP_DIR.match(d.name))
    stale = [d for d in root.iterdir() if d.name.endswith(".tmp") and STEP_DIR.match(d.name[:-4])]
    for old in saves[:-keep_last] + stale:
        shutil.rmtree(old, ignore_errors=True)


def export_hf(root: str | Path, state: dict[str, torch.Tensor], model: nn.Module, source: str) -> Path:
    """Write the trained policy as a Hugging Face model directory `root/final` (rank 0 only).

    `state` is the unsharded state dict (`grpo_trainer.moe.full_state_dict`); the tokenizer is
    copied from the source model, so the result loads with `from_pretrained` like the input did.
    """
    from transformers import AutoTokenizer

    final = Path(root) / "final"
    tmp = final.with_name("final.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load(path: Path, model: nn.Module, optimizer: Stateful, info: RankInfo) -> TrainState:
    """Restore this rank's shard, optimizer and RNG from a save; ConfigError if the gang's shape changed."""
    meta = json.loads((path / META).read_text())
    if (meta["world_size"], meta["ep_size"]) != (info.world_size, info.ep_size):
        raise ConfigError(
            f"{path}: saved by world size {meta['world_size']} / EP {meta['ep_size']}, "
            f"this gang is {info.world_size} / EP {info.ep_size}"
        )
    blob = torch.load(_rank_file(path, info.rank), map_location="cpu", weights_only=False)
    model.load_state_dict(blob["model"])
    optimizer.load_state_dict(blob["optimizer"])
    _set_rng_state(blob["rng"])
    return TrainState(**meta["state"])
