"""Runs inside vLLM's worker processes: applies a weight version given as safetensors buckets.

`VllmEngine` passes this class to `vllm.LLM(worker_extension_cls=...)`, vLLM's documented hook for
RLHF weight updates, and calls `grpo_load_weights` on every worker with `LLM.collective_rpc`. Each
worker (one per tensor-parallel rank) hands the tensors to the model's own `load_weights`, which
shards them as that rank needs. Imported by vLLM by name, never by our other modules.
"""

from typing import Any


class WeightLoader:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def grpo_load_weights(self, payloads: list[bytes]) -> int:
        import torch
        from safetensors.torch import load

        count = 0
        for data in payloads:
            tensors = load(data)
            self.model_runner.model.load_weights(weights=list(tensors.items()))
            count += len(tensors)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return count
