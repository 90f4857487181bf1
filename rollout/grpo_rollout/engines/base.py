"""The engine interface and its registry, used by the rollout server to generate and to swap weights.

An engine turns prompt texts into sampled token ids with exact per-token log-probs, and applies a
new weight version given as safetensors buckets. The server calls it from one worker thread, so an
engine never sees a generate and a weight load at the same time. Engines register by name with a
"module:factory" path, so a heavy backend (vLLM) is imported only when a job chooses it.
"""

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from grpo_rollout.protocol import FinishReason, Routing, Sampling


@dataclass(frozen=True)
class EngineConfig:
    model_path: str  # local directory of an HF-format model and its tokenizer
    dtype: str = "float32"  # bfloat16 | float16 | float32
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_batch_size: int = 256  # sequences decoded at once
    tensor_parallel_size: int = 1
    seed: int = 0


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    routing: Routing | None = None  # set when generate was asked for routing


@dataclass
class PromptSamples:
    prompt_token_ids: list[int]
    samples: list[Sample]


class Stopped(Exception):
    """Raised inside an engine when the server asked it to stop (draining): the batch is handed back."""


class Engine(Protocol):
    name: str

    def generate(
        self,
        prompts: Sequence[str],
        n: int,
        sampling: Sampling,
        should_stop: Callable[[], bool],
        *,
        routing: bool = False,
    ) -> list[PromptSamples | None]:
        """n samples per prompt, in order; None for prompts left unfinished because should_stop() said so.

        routing: also fill each Sample's `routing` (MoE routing replay); ValueError when the engine
        or its model cannot."""
        ...

    def load_weights(self, buckets: Sequence[bytes]) -> int:
        """Apply one complete weight version (safetensors buckets of HF names); return tensors updated.

        Must raise ValueError, before changing anything, for unknown names or mismatched shapes."""
        ...


ENGINES: dict[str, str] = {
    "torch": "grpo_rollout.engines.torch_engine:TorchEngine",
    "vllm": "grpo_rollout.engines.vllm_engine:VllmEngine",
}


def create_engine(name: str, config: EngineConfig) -> Engine:
    """Import the chosen engine's module only now, and build it."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; choose one of {sorted(ENGINES)}")
    module, _, attr = ENGINES[name].partition(":")
    factory: Callable[[EngineConfig], Engine] = getattr(importlib.import_module(module), attr)
    return factory(config)
