"""The vLLM engine (GPU): vLLM's offline `LLM` for sampling, its worker extension for weight updates.

Chosen by `rollout.engine: vllm` (the default on GPU fleets); imported only then, because vLLM is a
CUDA-only optional dependency (`grpo-operator[gpu]`). Log-probs come from vLLM with
`logprobs_mode="processed_logprobs"`, i.e. after temperature and top-p, which is exactly the
protocol's "log-prob under the sampling policy" that the torch engine computes by hand.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Any

from grpo_rollout.engines.base import EngineConfig, PromptSamples, Sample
from grpo_rollout.engines.hf_names import CheckpointNames
from grpo_rollout.protocol import Sampling

log = logging.getLogger(__name__)

MISSING = (
    "rollout engine 'vllm' needs the vllm package, which is CUDA-only: install grpo-operator[gpu] in a GPU "
    "image, or set spec.rollout.engine: torch to generate on CPU"
)


class VllmEngine:
    name = "vllm"

    def __init__(self, config: EngineConfig):
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError(f"{MISSING} ({e})") from e
        self._vllm = vllm
        self.max_batch_size = config.max_batch_size
        self.names = CheckpointNames(config.model_path)
        self.llm = vllm.LLM(
            model=config.model_path,
            dtype=config.dtype,
            tensor_parallel_size=config.tensor_parallel_size,
            seed=config.seed,
            max_num_seqs=config.max_batch_size,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="grpo_rollout.engines.vllm_worker.WeightLoader",
        )
        self.tokenizer = self.llm.get_tokenizer()
        log.info("vllm engine: %s (tp=%d, %s)", config.model_path, config.tensor_parallel_size, config.dtype)

    def _params(self, n: int, sampling: Sampling) -> list[Any]:
        """One SamplingParams per submitted prompt copy; a seeded request gets one seed per sample so
        the n samples differ yet repeat exactly."""
        common = dict(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
        )
        make = self._vllm.SamplingParams
        if sampling.seed is None:
            return [make(n=n, **common)]
        return [make(n=1, seed=sampling.seed + j, **common) for j in range(n)]

    def generate(
        self,
        prompts: Sequence[str],
        n: int,
        sampling: Sampling,
        should_stop: Callable[[], bool],
        *,
        routing: bool = False,
    ) -> list[PromptSamples | None]:
        if routing:  # vLLM >= 0.21 can (enable_return_routed_experts); not wired here yet
            raise ValueError("the vllm engine does not return routed experts yet: use rollout.engine torch")
        encoded = [self.tokenizer(p)["input_ids"] for p in prompts]
        if any(not ids for ids in encoded):
            raise ValueError("a prompt tokenizes to no tokens; give at least one character")
        params = self._params(n, sampling)
        copies = len(params)  # submissions per prompt
        per_chunk = max(1, self.max_batch_size // n)
        out: list[PromptSamples | None] = [None] * len(prompts)
        for start in range(0, len(prompts), per_chunk):
            if should_stop():
                break  # the rest is handed back
            chunk = encoded[start : start + per_chunk]
            requests = [{"prompt_token_ids": ids} for ids in chunk for _ in range(copies)]
            results = self.llm.generate(requests, params * len(chunk), use_tqdm=False)
            for i, ids in enumerate(chunk):
                outputs = [c for r in results[i * copies : (i + 1) * copies] for c in r.outputs]
                out[start + i] = PromptSamples(
                    prompt_token_ids=list(ids), samples=[self._sample(c) for c in outputs]
                )
        return out

    @staticmethod
    def _sample(c: Any) -> Sample:
        token_ids = list(c.token_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, token_ids, strict=True)]
        return Sample(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason="stop" if c.finish_reason == "stop" else "length",
            text=c.text,
        )

    def load_weights(self, buckets: Sequence[bytes]) -> int:
        """Rename and check every bucket first (ValueError before vLLM is touched), then load everywhere."""
        from safetensors.torch import load, save

        payloads = [save(self.names.to_checkpoint(load(data))) for data in buckets]
        counts = self.llm.collective_rpc("grpo_load_weights", args=(payloads,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return int(counts[0])
