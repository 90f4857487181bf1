"""Hugging Face exports of the policy: `save_pretrained`-loadable safetensors, config, tokenizer.

Called by the training loop on rank 0 with the unsharded state dict (`grpo_trainer.moe.full_state_dict`
gathered over rank 0's EP group) every `checkpoint.exportEverySteps` steps into
`<checkpointDir>/export/step-N` and at the end into `<checkpointDir>/final`, on the same store
as the checkpoints. The model is written to a local staging folder first; a local destination
is then swapped in by rename, a remote one uploaded with `config.json` last, so a reader that
finds `config.json` finds a complete model.
"""

import os
import shutil
import tempfile
from pathlib import Path

import torch
from grpo_operator import storage
from torch import nn

CONFIG = "config.json"


def export_hf(dest: str, state: dict[str, torch.Tensor], model: nn.Module, tokenizer_from: str) -> str:
    """Write `state` as an HF model directory at `dest` (s3:// or local); returns `dest`."""
    from transformers import AutoTokenizer

    seen: set[int] = set()
    out = {}
    for name, t in state.items():  # tied tensors share storage, which safetensors refuses
        out[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    local = not storage.is_remote(dest)
    parent = Path(dest).parent if local else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=parent))
    try:
        model.save_pretrained(staging, state_dict=out)
        AutoTokenizer.from_pretrained(tokenizer_from, local_files_only=True).save_pretrained(staging)
        if local:
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(staging, dest)
            return dest
        fs, path = storage.filesystem(dest)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        for f in sorted(files, key=lambda p: p.name == CONFIG):  # config.json last: the "done" sign
            fs.put_file(str(f), f"{path}/{f.relative_to(staging).as_posix()}")
        return dest
    finally:
        shutil.rmtree(staging, ignore_errors=True)
