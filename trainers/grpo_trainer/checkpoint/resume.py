"""Resume: the gang loads the newest readable save, resharded to its own shape.

Called once at start-up by `grpo_trainer.loop.setup` on every rank: `find_saves` before the model
is loaded, so a wrong `resumeFrom` fails the pod in its first seconds, and `resume` after. Rank 0
lists the saves (the job's own checkpointDir first; `checkpoint.resumeFrom` only when the job has
none of its own, resolved by `checkpoint.find`) and broadcasts them, or the error, as JSON: every
rank raises the same ConfigError. Every rank then reads the marker, checks each rank metadata
file against the sha256 the marker recorded, merges them into one DCP `Metadata` and loads the
keys it holds now (its experts, its ZeRO partition of the optimizer state), reading only their
byte ranges and checking their CRC-32s. A save any rank cannot read is skipped with a warning
and the one before is tried; when none is readable the job fails with a configuration error
(a restart cannot repair storage, and silently starting over would lose the run).
"""

import logging
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from grpo_operator import storage
from grpo_operator.api.status import Reason
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from grpo_trainer.checkpoint import find, layout, state
from grpo_trainer.checkpoint.dcp_io import CorruptCheckpoint, MergedReader, merge, read_rank_meta
from grpo_trainer.checkpoint.saver import list_saves
from grpo_trainer.config import ConfigError, RankInfo
from grpo_trainer.optim import GangAdamW
from grpo_trainer.parallel import broadcast_json

log = logging.getLogger(__name__)
# Each rank saves and loads on its own (no_dist=True) on purpose; DCP warns about that every time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


@dataclass
class Resumed:
    state: layout.TrainState
    path: str  # the save loaded
    warnings: list[str] = field(default_factory=list)  # saves skipped as unreadable, newest first


@dataclass(frozen=True)
class Saves:
    """The saves a starting gang tries, newest first, and whether they came from resumeFrom."""

    paths: list[str]
    from_resume_from: bool = False


def candidates(uri: str) -> list[str]:
    """Saves to try, newest first: `uri` itself when it is a save, else its complete saves."""
    fs, path = storage.filesystem(uri)
    if fs.exists(f"{path}/{layout.MARKER}"):
        return [uri]
    complete, _ = list_saves(uri)
    return [storage.join(uri, layout.step_name(s)) for s in layout.newest_first(complete)]


def _failures(e: CheckpointException) -> str:
    return "; ".join(str(getattr(f, "exception", f)) for f in e.failures.values())


def load_save(save_dir: str, model: nn.Module, optimizer: GangAdamW, info: RankInfo) -> layout.TrainState:
    """Fill `model`, `optimizer` and this rank's RNG from a save written at any gang shape."""
    t0 = time.monotonic()
    fs, path = storage.filesystem(save_dir)
    try:
        train_state, ranks = layout.parse_marker(fs.cat_file(f"{path}/{layout.MARKER}"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{layout.MARKER}: {e}") from e
    metadata = merge([read_rank_meta(fs, path, r, d) for r, d in ranks.items()], prefer_rank=info.rank)
    have = metadata.state_dict_metadata
    weights = state.model_entries(model)
    missing = sorted(k for k in weights if k not in have)
    if missing:
        raise CorruptCheckpoint(f"lacks {len(missing)} tensors of this model, e.g. {missing[:4]}")
    entries = {**weights, **state.optimizer_entries(model, optimizer, create=True), **state.rng_entries(info)}
    target = {k: e.tensor for k, e in entries.items() if k in have}
    reader = MergedReader(save_dir, metadata)
    try:
        dcp.load(target, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    except CheckpointException as e:  # a BaseException: DCP's wrapper of the reader's error
        raise CorruptCheckpoint(_failures(e)) from None
    state.drop_unloaded(model, optimizer, set(target))
    rng = f"{state.RNG}{info.rank}"
    if rng in target:
        torch.set_rng_state(target[rng])
    log.info("loaded %s (saved by world %d): %d tensors, %d bytes read in %.3fs",
             save_dir, len(ranks), len(target), reader.nbytes, time.monotonic() - t0)  # fmt: skip
    return train_state


def _rank0_saves(root: str, resume_from: str | None) -> Saves:
    own = candidates(root)
    if own or not resume_from:
        return Saves(own)
    return Saves(find.resume_from_candidates(resume_from), from_resume_from=True)


def find_saves(root: str, resume_from: str | None, info: RankInfo, device: torch.device) -> Saves:
    """Collective: the saves to try, the same on every rank; ConfigError on every rank when
    `resumeFrom` names none (never a silent fresh start)."""
    doc: dict | None = None
    if info.is_main:
        try:
            found = _rank0_saves(root, resume_from)
            doc = {"paths": found.paths, "from_resume_from": found.from_resume_from}
        except ConfigError as e:
            doc = {"error": str(e), "reason": e.reason}
    doc = broadcast_json(doc, device)
    if "error" in doc:
        raise ConfigError(doc["error"], reason=doc["reason"])
    return Saves(doc["paths"], doc["from_resume_from"])


def resume(
    root: str,
    resume_from: str | None,
    model: nn.Module,
    optimizer: GangAdamW,
    info: RankInfo,
    device: torch.device,
    saves: Saves | None = None,
) -> Resumed | None:
    """Collective: load the newest readable save for the gang (of `saves`, found by `find_saves`
    when not given); None when there is none and nothing named one (fresh)."""
    if saves is None:
        saves = find_saves(root, resume_from, info, device)
    warnings: list[str] = []
    for d in saves.paths:
        error = ""
        try:
            loaded = load_save(d, model, optimizer, info)
        except Exception as e:  # any failure to read means: try the save before it
            error = f"{type(e).__name__}: {e}"
        ok = torch.tensor([0.0 if error else 1.0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 1.0:
            return Resumed(loaded, d, warnings)
        why = f"rank {info.rank}: {error}" if error else "another rank could not read it"
        msg = f"checkpoint {d} is unreadable ({why}); falling back to the save before it"
        log.warning(msg)
        warnings.append(msg)
    if not saves.paths:
        return None
    if saves.from_resume_from:
        raise ConfigError(
            f"{find.FIELD} {resume_from}: none of its {len(saves.paths)} complete checkpoint(s) can be "
            f"read: {'; '.join(warnings)}",
            reason=Reason.RESUME_FROM_UNREADABLE,
        )
    raise ConfigError(
        f"none of the {len(saves.paths)} complete checkpoint(s) found for {root} "
        f"can be read: {'; '.join(warnings)}. Delete them to start over, or set checkpoint.resumeFrom",
        reason=Reason.CHECKPOINT_UNREADABLE,
    )
