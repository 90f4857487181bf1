"""The sequence-classification reward model (kind classifier): its single logit is the score.

The input is the tokenizer's chat template over [user: prompt, assistant: completion] (a chat prompt's
own messages, then the answer) when it has one, else the prompt's text followed by the completion:
how RLHF reward models (Skywork-Reward, the Qwen reward models) are trained to read. A model whose
head has more than one output is refused at load, naming spec.reward.model.path: a classifier's label
probabilities are not a reward.
"""

from typing import Any

from grpo_wire.protocol import ScoreItem

from grpo_rollout.reward_model.base import (
    KINDS,
    LoadConfig,
    Misconfigured,
    chat_input,
    conversation,
    prompt_text,
    torch_placement,
)

FIELD = "spec.reward.model.path"


def check_single_output(path: str, config: Any) -> None:
    """`Misconfigured` unless the model's head has exactly one output (num_labels 1)."""
    labels = getattr(config, "num_labels", None)
    if labels != 1:
        names = getattr(config, "id2label", None) or {}
        raise Misconfigured(
            f"{FIELD} {path!r} is a classifier with {labels} outputs (labels {sorted(names.values())}); "
            "a reward model has one (num_labels 1): its single logit is the score"
        )


def classifier_input(tokenizer: Any, item: ScoreItem) -> str:
    """What a classifier reads: the chat template over the prompt and the answer, else prompt + answer."""
    if tokenizer.chat_template:
        return chat_input(tokenizer, conversation(item), generation_prompt=False)
    return prompt_text(item.prompt) + item.completion


@KINDS.register("classifier")
class Classifier:
    engine = "reward-classifier"

    def __init__(self, config: LoadConfig, spec: Any):
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        check_single_output(config.path, AutoConfig.from_pretrained(config.path))
        self.batch_size: int = spec.batch_size
        self.device, dtype = torch_placement(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        model = AutoModelForSequenceClassification.from_pretrained(config.path, dtype=dtype)
        if model.config.pad_token_id is None:  # the head reads each row's last non-pad token
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to(self.device).eval()
        self._torch = torch

    def score(self, items: list[ScoreItem]) -> tuple[list[float], list[str | None]]:
        scores: list[float] = []
        for i in range(0, len(items), self.batch_size):
            texts = [classifier_input(self.tokenizer, item) for item in items[i : i + self.batch_size]]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with self._torch.no_grad():
                logits = self.model(**enc.to(self.device)).logits  # [B, 1]
            scores += logits[:, 0].float().tolist()
        return scores, [None] * len(scores)
