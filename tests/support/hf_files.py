"""A Hugging Face model folder read back tensor by tensor (one safetensors file or a sharded index),
for the export tests that compare what was written."""

import json
from pathlib import Path

import torch


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder by name, whichever file holds it."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    out: dict[str, torch.Tensor] = {}
    for name in files or ["model.safetensors"]:
        with safe_open(str(folder / name), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - not a mapping
    return out
