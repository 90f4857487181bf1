"""Prompts through the model's own chat template (`grpo_wire.chat`), with the tiny model's tokenizer
(its template ships in tokenizer_config.json / chat_template.jinja, as a real model's does)."""

from pathlib import Path

import pytest
from grpo_trainer.tiny_model import build_tokenizer
from grpo_wire.chat import ChatError, ChatSettings, PromptRenderer
from grpo_wire.protocol import Prompt

USER = [{"role": "user", "content": "3+4="}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(out)
    return out


def test_a_string_and_a_one_turn_chat_render_the_same_through_the_models_own_template(saved: Path) -> None:
    renderer = PromptRenderer.load(str(saved), ChatSettings())
    as_text = renderer.render(Prompt.of("a", "3+4=", {}))
    as_chat = renderer.render(Prompt.of("b", USER, {}))
    assert as_text == as_chat and as_chat.templated
    assert as_chat.text == "<|user|>3+4=<|end|><|assistant|>"  # the generation prompt is added
    tok = build_tokenizer()
    assert as_chat.token_ids == tok(as_chat.text, add_special_tokens=False).input_ids
    assert len(as_chat.token_ids) == 7  # each marker one token: no special token added twice


def test_the_system_prompt_goes_first_unless_the_chat_has_one(saved: Path) -> None:
    renderer = PromptRenderer.load(str(saved), ChatSettings(system_prompt="Add."))
    assert renderer.render(Prompt.of("a", USER, {})).text.startswith("<|system|>Add.<|end|><|user|>")
    own = [{"role": "system", "content": "Mine."}, *USER]
    assert renderer.render(Prompt.of("b", own, {})).text.startswith("<|system|>Mine.<|end|><|user|>")


def test_template_arguments_reach_the_template(tmp_path: Path) -> None:
    tok = build_tokenizer()
    tok.chat_template = (  # Qwen3-style switch
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}{{ '<|end|>' }}{% endif %}"
    )
    tok.save_pretrained(tmp_path)
    off = PromptRenderer.load(str(tmp_path), ChatSettings(kwargs={"enable_thinking": False}))
    on = PromptRenderer.load(str(tmp_path), ChatSettings())
    assert off.render(Prompt.of("a", USER, {})).text == "3+4=<|end|>"
    assert on.render(Prompt.of("a", USER, {})).text == "3+4="


def test_chat_template_none_keeps_raw_text_and_refuses_messages(saved: Path) -> None:
    renderer = PromptRenderer.load(str(saved), ChatSettings(template="none"))
    raw = renderer.render(Prompt.of("a", "3+4=", {}))
    assert raw.text == "3+4=" and not raw.templated and len(raw.token_ids) == 4
    with pytest.raises(
        ChatError, match=r"prompt b is a list of chat messages, but spec\.dataset\.chatTemplate is none"
    ):
        renderer.render(Prompt.of("b", USER, {}))
    with pytest.raises(ChatError, match="systemPrompt needs the chat template, but chatTemplate is none"):
        PromptRenderer.load(str(saved), ChatSettings(template="none", system_prompt="x"))


def test_a_model_without_a_template_takes_text_raw_and_says_why_it_refuses_messages(tmp_path: Path) -> None:
    tok = build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    renderer = PromptRenderer.load(str(tmp_path), ChatSettings())
    assert renderer.render(Prompt.of("a", "3+4=", {})).text == "3+4="
    with pytest.raises(
        ChatError,
        match=r"has no chat template \(tokenizer_config.json chat_template or chat_template.jinja\)",
    ):
        renderer.render(Prompt.of("b", USER, {}))


def test_a_template_that_fails_names_the_prompt_the_model_and_the_error(tmp_path: Path) -> None:
    tok = build_tokenizer()
    tok.chat_template = "{{ raise_exception('only user turns, please') }}"
    tok.save_pretrained(tmp_path)
    renderer = PromptRenderer.load(str(tmp_path), ChatSettings())
    with pytest.raises(ChatError) as e:
        renderer.render(Prompt.of("row-7", USER, {}))
    assert "prompt row-7: the chat template of" in str(e.value) and "only user turns, please" in str(e.value)
