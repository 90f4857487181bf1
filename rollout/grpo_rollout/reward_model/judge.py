"""The generative judge (kind generative): a causal LM asked through spec.reward.model.prompt, greedy.

Two pure steps around one `generate`: `render` fills the prompt template from an item (a name the row
lacks is `Misconfigured`, naming the field, for the whole batch: nothing is generated), and
`parse_score` reads the last match of scorePattern in the judge's text (group 1, else the whole
match); a text without a score scores 0.0 with an error, which the server counts as a parse failure.
"""

import math
import re
import string
from dataclasses import dataclass
from typing import Any

from grpo_wire.protocol import ScoreItem

from grpo_rollout.reward_model.base import (
    KINDS,
    LoadConfig,
    Misconfigured,
    chat_input,
    prompt_text,
    torch_placement,
)

FIELD = "spec.reward.model.prompt"
PREVIEW_CHARS = 200


def template_names(item: ScoreItem) -> dict[str, Any]:
    """What a template may name for this item: prompt, completion and the row's columns."""
    return {**item.columns, "prompt": prompt_text(item.prompt), "completion": item.completion}


def render(template: str, item: ScoreItem) -> str:
    """The judge's user message for `item`; `Misconfigured` naming FIELD for any template error."""
    names = template_names(item)
    try:
        return template.format(**names)
    except KeyError as e:
        missing = e.args[0]
        raise Misconfigured(
            f"{FIELD} names {{{missing}}}, which the row lacks; names available: {sorted(names)}"
        ) from None
    except IndexError:
        raise Misconfigured(
            f"{FIELD} has a positional field {{}}; name one of {sorted(names)}, e.g. {{completion}}"
        ) from None
    except (ValueError, AttributeError, TypeError) as e:
        raise Misconfigured(f"{FIELD} is not a valid format string: {e}") from None


def check_template(template: str) -> None:
    """Refuse a template that cannot format at all (unbalanced braces) before any request."""
    try:
        list(string.Formatter().parse(template))
    except ValueError as e:
        raise Misconfigured(f"{FIELD} is not a valid format string: {e}") from None


def parse_score(pattern: re.Pattern[str], text: str) -> tuple[float, str | None]:
    """(score, None) from the last match of `pattern` in `text`, or (0.0, why)."""
    matches = list(pattern.finditer(text))
    if not matches:
        return 0.0, f"no score in the judge's text: {text[:PREVIEW_CHARS]!r}"
    last = matches[-1]
    found = last.group(1) if pattern.groups else last.group(0)
    try:
        value = float(found)
    except (TypeError, ValueError):
        return 0.0, f"the judge's score {found!r} is not a number: {text[:PREVIEW_CHARS]!r}"
    if not math.isfinite(value):
        return 0.0, f"the judge's score is {value}"
    return value, None


def judge_input(tokenizer: Any, message: str) -> str:
    """The judge's whole input for one rendered message: one user turn, then the assistant's start."""
    return chat_input(tokenizer, [{"role": "user", "content": message}], generation_prompt=True)


@dataclass(frozen=True)
class NoAnswer:
    """An item the engine could not answer (too long for it): it scores 0 with `why`."""

    why: str


class Judging:
    """What the judges of both engines share: the prompt template and score pattern, and `score`
    over the engine's own greedy `generate` (a text per message, or `NoAnswer`)."""

    template: str
    pattern: "re.Pattern[str]"

    def configure(self, spec: Any) -> None:
        if not spec.prompt:
            raise Misconfigured(f"{FIELD} is required for a generative judge")
        check_template(spec.prompt)
        self.template = spec.prompt
        self.pattern = re.compile(spec.score_pattern)

    def generate(self, messages: list[str]) -> list[str | NoAnswer]:
        raise NotImplementedError

    def score(self, items: list[ScoreItem]) -> tuple[list[float], list[str | None]]:
        messages = [render(self.template, item) for item in items]  # every item first: no half batch
        parsed = [
            (0.0, text.why) if isinstance(text, NoAnswer) else parse_score(self.pattern, text)
            for text in self.generate(messages)
        ]
        return [s for s, _ in parsed], [e for _, e in parsed]


@KINDS.register("generative")
class Judge(Judging):
    engine = "reward-generative"

    def __init__(self, config: LoadConfig, spec: Any):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.configure(spec)
        self.max_new_tokens: int = spec.max_new_tokens
        self.batch_size: int = spec.batch_size
        self.device, dtype = torch_placement(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.path)
        self.tokenizer.padding_side = "left"  # generation continues every row from its last token
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(config.path, dtype=dtype)
        self.model = model.to(self.device).eval()
        self._torch = torch

    def generate(self, messages: list[str]) -> list[str | NoAnswer]:
        """The judge's greedy answers, in chunks of batchSize."""
        out: list[str | NoAnswer] = []
        for i in range(0, len(messages), self.batch_size):
            texts = [judge_input(self.tokenizer, m) for m in messages[i : i + self.batch_size]]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(self.device)
            with self._torch.no_grad():
                ids = self.model.generate(
                    **enc,
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )  # [B, P + new]
            new = ids[:, enc["input_ids"].shape[1] :]
            out += self.tokenizer.batch_decode(new, skip_special_tokens=True)
        return out
