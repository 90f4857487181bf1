"""Which of a vLLM worker's own parameters a weight version wrote (pure; `vllm_worker` feeds it).

A version goes live on a worker only when every parameter the worker holds was written by it: what
the trainer announced is not enough, because vLLM serves whatever a parameter holds. After a level-2
sleep a parameter nobody wrote is memory with no values in it (vllm 0.32.0 `v1/worker/gpu_worker.py:
294-311`), and vLLM's reload does not stop a version that misses one: a layer that received nothing
gets its old tensors back with a warning ("Failed to load weights", `model_loader/reload/layerwise.py:
255-267`), a layer that received part of its elements (an FP8 checkpoint's `weight_scale_inv` missing)
is processed anyway ("Delayed processing", `layerwise.py:269-275`).

Two readings of the worker, both vLLM's own bookkeeping, judged here:
- by name: the model's `load_weights` returns the names of the parameters it loaded (through the
  stacked and fused mappings: `q_proj` loads `qkv_proj.weight`, an expert loads `experts.w13_weight`),
  the same set vLLM's first load compares with `named_parameters()` (`model_loader/default_loader.py:
  520-567`). A tied `lm_head.weight` is the embedding's parameter, listed once by `named_parameters`.
- by element: a layer still open in the reload when the version finishes did not receive all of its
  elements (`LayerReloadingInfo.load_numel` < `load_numel_total`; a layer that did was processed
  while loading, `layerwise.py:216-219`, and is closed), so each of its parameters is partly written,
  unless vLLM pads the layer past the checkpoint (vocabulary rows filled with zeros instead of copied,
  `layers/vocab_parallel_embedding.py:519-520`) and every one of its tensors was loaded.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SHOWN = 5  # parameters named in a refusal; the count says how many more


@dataclass(frozen=True)
class OpenLayer:
    """A layer (module path) still open in vLLM's reload when the version finishes."""

    loaded: int  # elements its weight loaders copied (LayerReloadingInfo.load_numel)
    total: int  # elements it takes (load_numel_total)
    tensors: frozenset[str]  # its tensors that got at least one load (plus those the reload does not track)
    padded: bool = False  # vLLM pads it past the checkpoint: fewer elements than `total` can be whole


def unwritten(
    expected: Iterable[str], written: set[str] | None, open_layers: Mapping[str, OpenLayer]
) -> list[str]:
    """The expected parameters (full names) this version did not write, sorted; `written`: the names
    `load_weights` returned (None: the model returns none, so only the reload's reading applies).
    In an open layer, a parameter that got no load at all is named; when each got some, the layer's
    missing elements are in one of them (a slice of a fused one): each is named with the count."""
    names = sorted(expected)
    split = [name.rpartition(".") for name in names]
    never = {
        name
        for name, (module, _, tensor) in zip(names, split, strict=True)
        if (written is not None and name not in written)
        or (module in open_layers and tensor not in open_layers[module].tensors)
    }
    short = {  # open layers whose every expected parameter got a load, yet not all elements arrived
        module for module, layer in open_layers.items() if layer.loaded < layer.total and not layer.padded
    } - {module for name, (module, _, _) in zip(names, split, strict=True) if name in never}
    out = []
    for name, (module, _, _) in zip(names, split, strict=True):
        if name in never:
            out.append(name)
        elif module in short:
            layer = open_layers[module]
            out.append(f"{name} (its layer got {layer.loaded} of {layer.total} elements)")
    return out


def refusal(member: int, missing: list[str]) -> str:
    """Why worker `member` refuses the version: the first parameters it misses, and how many."""
    more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
    return (
        f"vLLM worker {member}: {len(missing)} of its parameters not written by this version: "
        f"{', '.join(missing[:SHOWN])}{more} (a version must write every parameter the worker holds)"
    )
