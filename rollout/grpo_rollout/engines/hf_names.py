"""Maps pushed weights (transformers in-memory names) to the model's checkpoint names, with checks.

The vLLM engine needs this: vLLM's `load_weights` reads checkpoint names (one tensor per expert),
while the trainer pushes `state_dict()` names of a transformers >= 5 model (experts fused into
`mlp.experts.gate_up_proj`/`down_proj`). transformers' own reverse conversion (the one
`save_pretrained` uses) does the mapping on a meta-device copy of the model, so no weights are
materialised. Names and shapes are checked against the checkpoint on disk before vLLM sees them.
"""

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from safetensors import safe_open


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name in the checkpoint with its shape, read from the safetensors headers only."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    files = files or ["model.safetensors"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(root / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_shapes(got: Mapping[str, Sequence[int]], have: Mapping[str, Sequence[int]], owner: str) -> None:
    """ValueError naming unknown names and shape mismatches of an update against what `owner` holds."""
    unknown = sorted(set(got) - set(have))
    if unknown:
        raise ValueError(f"{len(unknown)} unknown parameter name(s), e.g. {unknown[:3]}")
    wrong = [
        f"{k}: got {tuple(v)}, {owner} has {tuple(have[k])}"
        for k, v in got.items()
        if tuple(v) != tuple(have[k])
    ]
    if wrong:
        raise ValueError(f"{len(wrong)} shape mismatch(es): {'; '.join(wrong[:3])}")


class CheckpointNames:
    def __init__(self, model_dir: str | Path):
        self.model_dir = str(model_dir)
        self.shapes = checkpoint_shapes(model_dir)
        self._meta: Any = None

    def _meta_model(self) -> Any:
        if self._meta is None:
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            with torch.device("meta"):
                self._meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_dir))
        return self._meta

    def to_checkpoint(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint-named tensors for one bucket; ValueError naming unknown or misshapen tensors."""
        if not set(tensors) <= set(self.shapes):
            from transformers.core_model_loading import revert_weight_conversion

            tensors = revert_weight_conversion(self._meta_model(), dict(tensors))
        check_shapes({k: v.shape for k, v in tensors.items()}, self.shapes, "checkpoint")
        return tensors
