"""Runs inside vLLM's worker processes: one weight version, bucket by bucket, through vLLM's reload.

`VllmEngine` passes this class to vLLM as `worker_extension_cls` (vLLM's hook for RL weight
updates) and calls these methods on every worker (one per tensor-parallel rank, per data-parallel
replica) with `collective_rpc`: `grpo_begin_update`, `grpo_load_bucket` per bucket,
`grpo_finish_update`. They are the steps of vLLM's own checkpoint-format weight update
(`vllm.model_executor.model_loader.reload`): begin puts each layer in reload mode, the model's
`load_weights` shards what a bucket holds for this rank (experts this rank does not own are
skipped), and a layer is post-processed (`process_weights_after_loading`: repacked or quantized
MoE kernels, MLA) as soon as all of its tensors arrived, copied into the original storage so CUDA
graphs stay valid; finish processes what is left. Imported by vLLM by name, never by our modules.
"""

from typing import Any


class WeightLoader:
    model_runner: Any  # provided by the vLLM worker this class is mixed into
    vllm_config: Any
    device: Any

    def grpo_begin_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import start_reload

        self._grpo_loaded = 0
        with set_current_vllm_config(self.vllm_config):
            start_reload(self.model_runner.get_model())

    def grpo_load_bucket(self, payload: bytes) -> int:
        """Load one safetensors bucket of checkpoint-named tensors; returns how many it held."""
        import torch
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        tensors = load(payload)
        with set_current_vllm_config(self.vllm_config), torch.device(self.device):
            self.model_runner.get_model().load_weights(weights=list(tensors.items()))
        self._grpo_loaded = getattr(self, "_grpo_loaded", 0) + len(tensors)
        return len(tensors)

    def grpo_finish_update(self) -> int:
        """Post-process the layers not yet done; returns the tensors loaded since begin."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finish_reload

        with set_current_vllm_config(self.vllm_config):
            finish_reload(self.model_runner.get_model(), self.vllm_config.model_config, self.device)
        torch.accelerator.synchronize()
        return getattr(self, "_grpo_loaded", 0)
