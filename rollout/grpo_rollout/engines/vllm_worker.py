"""Runs inside vLLM's worker processes: one weight version, bucket by bucket, through vLLM's reload.

`VllmEngine` passes this class to vLLM as `worker_extension_cls` (vLLM's hook for RL weight
updates) and calls these methods on every worker (one per tensor-parallel rank, per data-parallel
replica) with `collective_rpc`: `grpo_begin_update`, `grpo_load_bucket` per bucket, then
`grpo_finish_update` or `grpo_abort_update`. They are the steps of vLLM 0.32's layerwise reload
(`vllm.model_executor.model_loader.reload`): `initialize_layerwise_reload` puts each layer on the
meta device and wraps its weight loaders; the model's `load_weights` shards what a bucket holds for
this rank (experts this rank does not own are skipped), and a layer is post-processed
(`process_weights_after_loading`: repacked or quantized MoE kernels, MLA) as soon as all of its
tensors arrived, then copied into its original storage so CUDA graphs stay valid;
`finalize_layerwise_reload` processes what is left. Called by vLLM by name, never by our modules (the
engine registry imports every module of this package, so vLLM is imported here only inside functions).

Two gaps of vLLM 0.32 are closed here:
- Fused-MoE experts are not repacked on a reload: `UnquantizedFusedMoEMethod._setup_kernel` calls
  `fused_experts.process_weights_after_loading(layer)` only on the first load (`moe_kernel is
  None`), on every platform. On CPU that hook prepacks the expert weights for the grouped GEMM,
  so without it the new weights sit in the kernel's storage unpacked (log-probs drift by ~0.03);
  on GPU the unquantized experts' hook is a no-op (Triton, FlashInfer) or bookkeeping (MoonEP).
  `repack_experts` runs the hook on every experts layer that took new weights, keeping storage.
- vLLM has no abort. What it can undo: a layer whose tensors have not all arrived still holds
  its old kernel tensors (the new ones wait in a buffer), so `grpo_abort_update` drops those
  buffers and puts the old tensors back. A layer already processed was overwritten in place and
  cannot be restored: abort reports how many, and the engine refuses to generate until the next
  whole version (the service's `torn` flag does the same for streamed versions).

And a version goes live only when it wrote every parameter this worker holds (`vllm_written`, read
from the model's own `load_weights` answers and the reload's per-layer counts): `grpo_finish_update`
refuses one that misses any, naming them, before vLLM processes what is left.
A finish that fails inside vLLM leaves no update open (`grpo_abort_update` is then a no-op; the engine
refuses these weights), and the next `grpo_begin_update` first closes any layer it left in the reload.
"""

import logging
from collections.abc import Iterable
from typing import Any

from grpo_rollout.engines import vllm_written

log = logging.getLogger(__name__)


def reloading(model: Any) -> list[Any]:
    """The modules whose reload is still open: their new tensors are buffered, the old in place."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return [m for m in model.modules() if get_layerwise_info(m).can_load()]


def processed(model: Any) -> list[Any]:
    """The modules already post-processed with new weights during loading (their info was reset)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return [m for m in model.modules() if not get_layerwise_info(m).can_load()]


def repack_experts(layers: Iterable[Any]) -> int:
    """Run the fused-experts kernel's own post-load hook on the unquantized experts layers among
    `layers`, as vLLM's first load does, then copy what it produced into the original parameters
    (same storage: captured CUDA graphs stay valid). Returns the layers repacked."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    count = 0
    for layer in layers:
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        kept = dict(layer.named_parameters(recurse=False))
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)
        for name, old in kept.items():
            new = getattr(layer, name)
            if new is old:
                continue
            if new.shape != old.shape or new.dtype != old.dtype:
                raise RuntimeError(
                    f"{type(layer).__name__}.{name}: the experts kernel repacked {tuple(old.shape)} "
                    f"{old.dtype} into {tuple(new.shape)} {new.dtype}; it cannot go back into its storage"
                )
            old.data.copy_(new)
            layer.register_parameter(name, old)
        count += 1
    return count


class WeightLoader:
    model_runner: Any  # provided by the vLLM worker this class is mixed into
    vllm_config: Any
    device: Any

    def grpo_begin_update(self) -> None:
        """Open vLLM's reload: first close one a failed finish left open (`_grpo_close_stale`), then
        note the parameters this version must write (before the reload puts them on meta, where a
        tied head is a parameter of its own)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()
        self._grpo_close_stale(model)
        self._grpo_expected = expected_parameters(model)
        self._grpo_written: set[str] | None = set()
        self._grpo_loaded = 0
        self._grpo_open = True  # before vLLM's call: an abort also closes a reload it left half-open
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)

    def grpo_load_bucket(self, payload: bytes) -> int:
        """Load one safetensors bucket of checkpoint-named tensors; returns how many it held."""
        from safetensors.torch import load

        return self.grpo_load_tensors(load(payload))

    def grpo_load_tensors(self, tensors: dict[str, Any]) -> int:
        """Load checkpoint-named tensors (a streamed bucket: already on this worker's device);
        returns how many. The names of the parameters `load_weights` wrote are kept."""
        import torch
        from vllm.config import set_current_vllm_config

        if not getattr(self, "_grpo_open", False):
            raise RuntimeError("grpo_load_tensors without an open update (grpo_begin_update)")
        with set_current_vllm_config(self.vllm_config), torch.device(self.device):
            names = self.model_runner.get_model().load_weights(weights=list(tensors.items()))
        if names is None or self._grpo_written is None:  # a model that does not say what it loaded
            self._grpo_written = None
        else:
            self._grpo_written |= set(names)
        self._grpo_loaded += len(tensors)
        return len(tensors)

    def grpo_unwritten(self) -> list[Any]:
        """[this worker's member index, the parameters it holds that the open update did not write
        (`vllm_written.unwritten`)]; nothing changes."""
        from grpo_rollout.engines.vllm_stream import member_index

        if not getattr(self, "_grpo_open", False):
            raise RuntimeError("grpo_unwritten without an open update (grpo_begin_update)")
        model = self.model_runner.get_model()
        missing = vllm_written.unwritten(self._grpo_expected, self._grpo_written, open_layers(model))
        return [member_index(self.vllm_config.parallel_config), missing]

    def grpo_finish_update(self) -> int:
        """Refuse a version that did not write every parameter this worker holds (ValueError naming
        them; the reload stays open for the abort); else post-process the layers not yet done,
        repack the experts; returns the tensors loaded."""
        member, missing = self.grpo_unwritten()
        if missing:
            raise ValueError(vllm_written.refusal(member, missing))
        model = self.model_runner.get_model()
        # finalize processes every layer that got something; the others keep their old tensors
        touched = processed(model) + [m for m in reloading(model) if _got_weights(m)]
        self._grpo_open = False  # from here vLLM writes in place: nothing can be undone
        self._grpo_finalize(model)
        repack_experts(touched)
        self._grpo_reset_caches()
        return self._grpo_loaded

    def grpo_abort_update(self) -> int:
        """Close the reload keeping old weights where vLLM still has them; returns the layers that
        already hold new weights (0: the model is exactly as before begin, or no update was open,
        as after a finish that failed: the engine then judges the weights itself)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        if not getattr(self, "_grpo_open", False):
            return 0
        model = self.model_runner.get_model()
        for module in reloading(model):
            get_layerwise_info(module).load_numel = 0  # finalize then puts the old tensors back
        taken = processed(model)
        self._grpo_open = False
        self._grpo_finalize(model)
        repack_experts(taken)  # a torn model stays well-formed until the next version replaces it
        self._grpo_reset_caches()
        self._grpo_loaded = 0
        return len(taken)

    def grpo_stream_member(self) -> int:
        """This worker's index among the engine's stream members (`vllm_stream.member_index`)."""
        from grpo_rollout.engines.vllm_stream import member_index

        return member_index(self.vllm_config.parallel_config)

    def grpo_held_experts(self) -> list[Any]:
        """[this worker's member index, the routed experts it keeps or None]: read from its own MoE
        layers' expert maps (`vllm_stream.experts_in_model`), what vLLM placed, not what we expect it
        to place; the placement computed from the config (`vllm_stream.held_experts`, which also
        refuses EPLB) only where the model maps none. A disagreement is logged: it means the trainer's
        view of vLLM's placement (`grpo_wire.holdings`) is stale."""
        from grpo_rollout.engines.vllm_stream import experts_in_model, held_experts, member_index

        expected = held_experts(self.vllm_config)
        own = experts_in_model(self.model_runner.get_model())
        if own is not None and own != expected:
            log.warning(
                "vLLM keeps experts %s here, the config's placement says %s: sending vLLM's", own, expected
            )
        return [member_index(self.vllm_config.parallel_config), own if own is not None else expected]

    def grpo_receive_stream(self, request_json: str, refused: bool) -> dict[str, Any]:
        """Receive a streamed version as a member of the trainer's weight groups and load it here
        (`vllm_stream.receive_in_worker`); returns the member's outcome as a dict."""
        from grpo_rollout.engines.vllm_stream import receive_in_worker

        return receive_in_worker(self, request_json, refused)

    def _grpo_close_stale(self, model: Any) -> None:
        """A finish that failed inside vLLM's finalize leaves layers open in the reload, holding
        the broken version's buffered tensors; `initialize_layerwise_reload` would skip them
        (`layerwise.py:104-106`) and load those stale tensors with the next version's. Close them
        as an abort does (old tensors back: the engine already refuses to serve these weights)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        stale = reloading(model)
        if not stale:
            return
        for module in stale:
            get_layerwise_info(module).load_numel = 0
        self._grpo_finalize(model)

    def _grpo_finalize(self, model: Any) -> None:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config), torch.device(self.device):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        if torch.accelerator.is_available():  # the copies are done before the engine serves again
            torch.accelerator.synchronize()

    def _grpo_reset_caches(self) -> None:
        """What vLLM's own `reload_weights` resets after a reload (state derived from the old
        weights); the prefix cache lives in the scheduler and is reset by the engine."""
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()


def expected_parameters(model: Any) -> set[str]:
    """The parameters a version must write: the model's `named_parameters()` (a shared one once, so
    a tied head is the embedding), less those no checkpoint carries, which vLLM's own first-load
    check leaves out too (vllm 0.32.0 `model_loader/default_loader.py:526-567`): KV-cache scales
    (`BaseKVCacheMethod`: defaults when a checkpoint has none), online quantization's parameters
    (made while loading), empty placeholders and `_CONFIG_BUILT_PARAMS`; and only those of the layout
    the reload loads into (each layer's `restore_metadata`, recorded when the model was built,
    `model_loader/utils.py:96`), not one a kernel registered while processing. Read outside a reload
    (during one the parameters are meta stand-ins, a tied head's apart from the embedding's)."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    from vllm.model_executor.model_loader.default_loader import _CONFIG_BUILT_PARAMS
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    names = {name for name, p in model.named_parameters() if p.numel() > 0}
    loadable = set()
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        method = getattr(module, "quant_method", None)
        if isinstance(method, BaseKVCacheMethod) or getattr(method, "uses_meta_device", False):
            names -= {prefix + n for n, _ in module.named_parameters()}
        loadable |= {prefix + n for n in get_layerwise_info(module).restore_metadata[0]}
    return {n for n in names & loadable if n.rsplit(".", 1)[-1] not in _CONFIG_BUILT_PARAMS}


def open_layers(model: Any) -> dict[str, vllm_written.OpenLayer]:
    """Each layer still open in vLLM's reload, by module path: what it received so far. Tensors the
    reload does not track (`SKIP_LOAD_TENSORS`, loaded without the layer's wrapper) count as
    received here; `load_weights`' names judge them."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    out = {}
    for path, module in model.named_modules():
        info = get_layerwise_info(module)
        if not info.can_load():
            continue
        tensors = {name for name, _ in info.loaded_weights} | SKIP_LOAD_TENSORS
        out[path] = vllm_written.OpenLayer(
            loaded=int(info.load_numel),
            total=int(info.load_numel_total or 0),
            tensors=frozenset(tensors),
            padded=isinstance(module, VocabParallelEmbedding),
        )
    return out


def _got_weights(module: Any) -> bool:
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(module).load_numel > 0
