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

from grpo_operator.api.spec import DatasetSpec

from grpo_wire.protocol import Prompt

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
    def of(cls, dataset: DatasetSpec) -> "ChatSettings":
        """The job's spec.dataset settings."""
        return cls(str(dataset.chat_template), dict(dataset.chat_template_kwargs), dataset.system_prompt)


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    text: str  # what the model reads, special tokens included
    templated: bool  # went through the chat template


class PromptRenderer:
    """Renders prompts for one model; thread-safe (a Rust tokenizer is not re-entrant)."""

    def __init__(
        self,
        tokenizer: Any,
        settings: ChatSettings,
        model: str = "the model",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        """`tools`: the JSON schemas of the job's tools, which the template describes to the model."""
        self.tokenizer, self.settings, self.model = tokenizer, settings, model
        self.tools = tools or None
        self.template: str | None = getattr(tokenizer, "chat_template", None) or None
        self._lock = threading.Lock()
        self.check_settings()

    @classmethod
    def load(
        cls, model_path: str, settings: ChatSettings, tools: list[dict[str, Any]] | None = None
    ) -> "PromptRenderer":
        from transformers import AutoTokenizer  # heavy; only where prompts are rendered

        return cls(AutoTokenizer.from_pretrained(model_path), settings, model_path, tools)

    @property
    def uses_template(self) -> bool:
        return self.settings.template == "auto" and self.template is not None

    def check_settings(self) -> None:
        """Settings that cannot work with this model, said before any prompt is."""
        why = "chatTemplate is none" if self.settings.template == "none" else self._no_template()
        if self.settings.system_prompt is not None and not self.uses_template:
            raise ChatError(f"spec.dataset.systemPrompt needs the chat template, but {why}")
        if self.tools and not self.uses_template:
            raise ChatError(f"spec.tools needs the chat template (it describes the tools), but {why}")

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
            text = self._apply(chat, True, f"prompt {prompt.id}")
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return Rendered(ids, text, templated=True)

    def _apply(self, chat: list[dict[str, Any]], generation_prompt: bool, what: str) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                chat,
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.settings.kwargs,
            )
        except Exception as e:  # jinja2's TemplateError and whatever the template raises itself
            raise ChatError(
                f"{what}: the chat template of {self.model} failed to render it "
                f"({TEMPLATE_FIELD}Kwargs {dict(self.settings.kwargs)}): {type(e).__name__}: {e}"
            ) from None

    def decode(self, ids: list[int]) -> str:
        """Token ids as text, special tokens included."""
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False)

    def continuation(self, tool_messages: list[dict[str, Any]], stop_text: str) -> list[int]:
        """The tokens that follow a model turn which ended with `stop_text` (its last token, an end
        of turn; "" when it did not end with one) and called tools: the rest of what the template
        writes after an assistant turn, the tool messages, and the opening of the next assistant
        turn — the template's own text, rendered on a stand-in conversation (token-in/token-out:
        the turns before are never rendered again). ChatError when the template changes earlier
        turns as tool messages follow (it cannot be continued this way)."""
        marker = "\x00turn\x00"  # text no template writes by itself
        chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}]
        with self._lock:
            base = self._apply(chat, False, "a model turn")
            full = self._apply([*chat, *tool_messages], True, "tool results")
            if not full.startswith(base) or marker not in base:
                raise ChatError(
                    f"the chat template of {self.model} renders earlier turns differently once tool "
                    "messages follow: multi-turn episodes cannot be continued token by token with it"
                )
            after = base[base.rindex(marker) + len(marker) :]  # what closes an assistant turn
            rest = after[len(stop_text) :] if stop_text and after.startswith(stop_text) else after
            return list(self.tokenizer(rest + full[len(base) :], add_special_tokens=False)["input_ids"])
