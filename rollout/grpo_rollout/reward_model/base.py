"""What a reward model is to its server: one `score` over a batch of items, and the registries.

Each engine (spec.reward.model.engine) registers a loader in `ENGINES`; the torch engine's kinds
(spec.reward.model.kind) are one file each, registered in `KINDS` (`@KINDS.register("classifier")`),
and the vllm engine serves both kinds from `vllm_engine`. `grpo_rollout.reward_model.server` loads the
job's model with `load` and calls `score` on its model thread. A kind raises `Misconfigured` for what
no retry can fix (a model whose output is not a score, a judge prompt naming a column the row lacks):
the server answers 422 `reward_misconfigured` with the message, naming the spec field.
"""

from dataclasses import dataclass
from typing import Any, Protocol

from grpo_wire.protocol import ChatMessage, ScoreItem
from grpo_wire.registry import Registry


class Misconfigured(Exception):
    """The job's reward model cannot score as configured; the message names the spec field."""


@dataclass(frozen=True)
class LoadConfig:
    """How the server loads the model: where, on what, in what precision."""

    path: str  # local directory (an s3:// path is fetched by the caller first)
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: str = "float32"  # float32, bfloat16, float16


class RewardModel(Protocol):
    """A loaded reward model; `score` runs on the server's single model thread."""

    engine: str  # what /health reports: "reward-classifier", "reward-generative"

    def score(self, items: list[ScoreItem]) -> tuple[list[float], list[str | None]]:
        """One score per item (0.0 with an error where an item has none); `Misconfigured` for the batch."""
        ...


# kind -> the torch engine's loader(LoadConfig, RewardModelSpec) -> RewardModel; engine -> loader(kind,
# LoadConfig, RewardModelSpec) -> RewardModel. Names pinned to the API enums (test_mirrors).
KINDS: Registry[Any] = Registry("reward model kind", home="grpo_rollout.reward_model")
ENGINES: Registry[Any] = Registry("reward model engine", home="grpo_rollout.reward_model")


DTYPES = ("float32", "bfloat16", "float16")


def torch_placement(config: LoadConfig) -> tuple[Any, Any]:
    """(device, dtype) of torch for `config`: auto picks CUDA when there is one."""
    import torch  # only a loading kind needs it

    if config.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {config.dtype!r}; choose one of {list(DTYPES)}")
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device), getattr(torch, config.dtype)


@ENGINES.register("torch")
def load_torch(kind: str, config: LoadConfig, spec: Any) -> RewardModel:
    return KINDS.get(kind)(config, spec)


def load(kind: str, config: LoadConfig, spec: Any) -> RewardModel:
    return ENGINES.get(str(getattr(spec, "engine", "torch")))(kind, config, spec)


def chat_input(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
    """`messages` through the tokenizer's chat template (a judge's adds the assistant's turn start),
    or, for a tokenizer without one, their contents joined: what both engines feed a model."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    return "".join(m.get("content") or "" for m in messages)


def prompt_text(prompt: str | list[ChatMessage]) -> str:
    """A chat prompt as plain text (its messages' contents, one per line): what a judge's {prompt}
    and a classifier without a chat template read."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m.content or "" for m in prompt)


def conversation(item: ScoreItem) -> list[dict[str, Any]]:
    """The item as chat messages: the prompt (one user turn, or its own messages), then the answer."""
    if isinstance(item.prompt, str):
        head: list[dict[str, Any]] = [{"role": "user", "content": item.prompt}]
    else:
        head = [m.model_dump(exclude_none=True) for m in item.prompt]
    return [*head, {"role": "assistant", "content": item.completion}]
