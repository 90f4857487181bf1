"""Checkpoints of the trainer gang with torch.distributed.checkpoint: sharded, async, resharding.

Public API (the training loop uses only this):

    checkpoint.TrainState                       the loop's counters (step, weight version, data position)
    checkpoint.check_root(root, info)           start-up: this rank can write, read and list the root
    checkpoint.Saver(root, info, group, ...)    .save(state, tensors) async, .wait(), .close(), .last
    checkpoint.gang_state(model, opt, info)     the tensors this rank writes, in the global key space
    checkpoint.find_saves(root, resume_from, ...)  collective, before the model loads: saves to try
    checkpoint.resume(root, resume_from, ...)   collective: load the newest readable save, resharded
    checkpoint.export_hf(model, dest, ...)      collective: Hugging Face export, every rank writing

Modules: `layout` (names, marker, pure choices), `state` (the key space), `dcp_io` (DCP storage
without pickle), `saver`, `resume`, `export` (with `export_plan` and `safetensors_stream`). The
layout and guarantees are in `layout`'s docstring and docs/install-eks.md ("Checkpoints").
"""

from torch import nn

from grpo_trainer.checkpoint.export import export_hf
from grpo_trainer.checkpoint.layout import EXPORT_DIR, FINAL_DIR, MARKER, TrainState, step_name
from grpo_trainer.checkpoint.resume import Resumed, Saves, candidates, find_saves, load_save, resume
from grpo_trainer.checkpoint.saver import Saver, check_root, list_saves
from grpo_trainer.checkpoint.state import model_entries, optimizer_entries, rank_state, rng_entries
from grpo_trainer.config import RankInfo
from grpo_trainer.optim import GangAdamW


def gang_state(model: nn.Module, optimizer: GangAdamW, info: RankInfo) -> dict:
    """What this rank writes in a save: its share of weights, optimizer state and its RNG."""
    entries = {**model_entries(model), **optimizer_entries(model, optimizer), **rng_entries(info)}
    return rank_state(entries, info)


__all__ = [
    "EXPORT_DIR",
    "FINAL_DIR",
    "MARKER",
    "Resumed",
    "Saver",
    "Saves",
    "TrainState",
    "candidates",
    "check_root",
    "export_hf",
    "find_saves",
    "gang_state",
    "list_saves",
    "load_save",
    "resume",
    "step_name",
]
