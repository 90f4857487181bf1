"""How a prompt becomes the token ids a model sees: through the model's own chat template.

Used by the rollout server for every prompt it generates from, and by the trainer's start-up
check and `grpo-operator preview` (`grpo_trainer.preview`), so what a user previews is what the
model receives. The template is the model's (`tokenizer_config.json`'s `chat_template`, or
`chat_template.jinja` beside it, as transformers loads them), never one of ours; it renders
with the generation prompt added and the job's `spec.dataset.chatTemplateKwargs` (e.g.
`enable_thinking: false`), then the text is tokenized without adding special tokens again (the
template wrote them). `spec.dataset.chatTemplate: none`, or a model without a template, keeps a
string prompt as raw text (tokenized as the tokenizer does by default); a message list then has
nothing to render it and is refused.
"""

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpo_rollout.protocol import Prompt

TEMPLATE_FIELD = "spec.dataset.chatTemplate"


class ChatError(ValueError):
    """A prompt that cannot be rendered: the field or the template, and why."""


@dataclass(frozen=True)
class ChatSettings:
    """The job's chat settings (spec.dataset.chatTemplate, chatTemplateKwargs, systemPrompt)."""

    template: str = "auto"  # auto | none
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None

    @classmethod
    def of(cls, dataset: Any) -> "ChatSettings":
        """From a `grpo_operator.api.spec.DatasetSpec`."""
        return cls(str(dataset.chat_template), dict(dataset.chat_template_kwargs), dataset.system_prompt)


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    text: str  # what the model reads, special tokens included
    templated: bool  # went through the chat template


class PromptRenderer:
    """Renders prompts for one model; thread-safe (a Rust tokenizer is not re-entrant)."""

    def __init__(self, tokenizer: Any, settings: ChatSettings, model: str = "the model") -> None:
        self.tokenizer, self.settings, self.model = tokenizer, settings, model
        self.template: str | None = getattr(tokenizer, "chat_template", None) or None
        self._lock = threading.Lock()
        self.check_settings()

    @classmethod
    def load(cls, model_path: str, settings: ChatSettings) -> "PromptRenderer":
        from transformers import AutoTokenizer  # heavy; only where prompts are rendered

        return cls(AutoTokenizer.from_pretrained(model_path), settings, model_path)

    @property
    def uses_template(self) -> bool:
        return self.settings.template == "auto" and self.template is not None

    def check_settings(self) -> None:
        """Settings that cannot work with this model, said before any prompt is."""
        if self.settings.system_prompt is not None and not self.uses_template:
            why = "chatTemplate is none" if self.settings.template == "none" else self._no_template()
            raise ChatError(f"spec.dataset.systemPrompt needs the chat template, but {why}")

    def _no_template(self) -> str:
        return (
            f"{self.model} has no chat template (tokenizer_config.json chat_template or chat_template.jinja)"
        )

    def messages(self, prompt: Prompt) -> list[dict[str, Any]] | None:
        """The chat the template renders (the system prompt put first unless it has one), or None
        for raw text."""
        if prompt.messages is None and not self.uses_template:
            return None
        if not self.uses_template:
            why = (
                "spec.dataset.chatTemplate is none"
                if self.settings.template == "none"
                else self._no_template()
            )
            raise ChatError(f"prompt {prompt.id} is a list of chat messages, but {why}")
        chat = prompt.raw if prompt.messages is not None else [{"role": "user", "content": prompt.text}]
        assert isinstance(chat, list)
        if self.settings.system_prompt is not None and chat[0].get("role") != "system":
            chat = [{"role": "system", "content": self.settings.system_prompt}, *chat]
        return chat

    def render(self, prompt: Prompt) -> Rendered:
        """Token ids and text of `prompt` as the model receives it; ChatError naming what failed."""
        chat = self.messages(prompt)
        with self._lock:
            if chat is None:
                assert prompt.text is not None
                ids = list(self.tokenizer(prompt.text)["input_ids"])
                return Rendered(ids, prompt.text, templated=False)
            try:
                text = self.tokenizer.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=True, **self.settings.kwargs
                )
            except Exception as e:  # jinja2's TemplateError and whatever the template raises itself
                raise ChatError(
                    f"prompt {prompt.id}: the chat template of {self.model} failed to render it "
                    f"({TEMPLATE_FIELD}Kwargs {dict(self.settings.kwargs)}): {type(e).__name__}: {e}"
                ) from None
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return Rendered(ids, text, templated=True)
