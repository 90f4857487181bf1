"""The Hermes tool-call parser (grpo_rollout.tools.parsers): what the model writes, in the shapes it takes.

Well-formed calls in every form the Hermes/Qwen family emits, and malformed ones in many shapes: each
malformed call is an error line, never an exception, and never costs the well-formed calls beside it.
"""

import json

import pytest
from grpo_rollout.tools import parsers
from grpo_rollout.tools.parsers import HermesParser, ToolCall


def parse(text: str) -> parsers.ParsedTurn:
    return HermesParser().parse(text)


def test_one_call_in_the_qwen_layout_and_the_text_around_it():
    turn = parse(
        "Let me add them.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>\nDone.'
    )
    assert turn.calls == [ToolCall("calculator", {"expression": "2 + 3"}, "call_0")]
    assert turn.content == "Let me add them.\n\nDone."
    assert turn.errors == []


def test_several_calls_in_one_turn_keep_their_order_and_are_numbered():
    text = "".join(
        f'<tool_call>{{"name": "f{i}", "arguments": {{"i": {i}}}}}</tool_call>\n' for i in range(3)
    )
    turn = parse(text)
    assert [(c.name, c.arguments, c.id) for c in turn.calls] == [
        ("f0", {"i": 0}, "call_0"),
        ("f1", {"i": 1}, "call_1"),
        ("f2", {"i": 2}, "call_2"),
    ]
    assert turn.content == ""


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}', {"x": [1, 2]}),  # double-encoded
        ('{"name": "f", "arguments": ""}', {}),
        ('{"name": "f"}', {}),
        ('{"name": "f", "arguments": null}', {}),
        ('{"arguments": {"q": "é✓"}, "name": " f "}', {"q": "é✓"}),  # key order, unicode, padded name
        ('{"name": "f", "arguments": {"nested": {"a": {"b": [{}]}}}}', {"nested": {"a": {"b": [{}]}}}),
    ],
)
def test_argument_forms_the_family_writes(body, arguments):
    turn = parse(f"<tool_call>\n{body}\n</tool_call>")
    assert turn.errors == []
    assert turn.calls == [ToolCall("f", arguments, "call_0")]


def test_an_end_tag_inside_an_argument_string_does_not_split_the_call():
    code = 'print("</tool_call>")\nprint("<tool_call>")'
    text = f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call> after"
    turn = parse(text)
    assert turn.errors == []
    assert turn.calls == [ToolCall("python", {"code": code}, "call_0")]
    assert turn.content == "after"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "f", "arguments": {"x": 1}', "invalid JSON"),
        ("{'name': 'f', 'arguments': {}}", "invalid JSON"),  # Python, not JSON
        ("", "invalid JSON"),
        ("not json at all", "invalid JSON"),
        ('{"name": "f"} trailing words', "text after the JSON object"),
        ('["f", {"x": 1}]', "expected a JSON object with 'name' and 'arguments', got an array"),
        ('"f"', "got a string"),
        ("42", "got a number"),
        ('{"arguments": {"x": 1}}', "missing 'name'"),
        ('{"name": "", "arguments": {}}', "missing 'name'"),
        ('{"name": 7, "arguments": {}}', "missing 'name'"),
        ('{"name": "f", "arguments": [1, 2]}', "'arguments' must be a JSON object, got an array"),
        ('{"name": "f", "arguments": "x=1"}', "'arguments' is a string but not JSON"),
        ('{"name": "f", "arguments": "[1]"}', "'arguments' must be a JSON object, got an array"),
        ('{"name": "f", "arguments": 3}', "'arguments' must be a JSON object, got a number"),
    ],
)
def test_a_malformed_call_is_an_error_line_between_good_calls(body, error):
    good = '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    turn = parse(f"before {good} <tool_call>{body}</tool_call> {good} after")
    assert [c.name for c in turn.calls] == ["ok", "ok"]
    assert [c.id for c in turn.calls] == ["call_0", "call_1"]  # ids count calls, not errors
    assert len(turn.errors) == 1
    assert turn.errors[0].startswith("tool call 2")
    assert error in turn.errors[0]
    assert turn.content == "before    after"  # the malformed call's text is not content either


@pytest.mark.parametrize(
    "tail",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}',  # cut by max tokens right after the JSON
        '<tool_call>\n{"name": "f", "argum',  # cut inside it
        "<tool_call>",
    ],
)
def test_an_unclosed_call_is_an_error_not_a_call(tail):
    turn = parse(f'<tool_call>{{"name": "ok"}}</tool_call>\nthinking... {tail}')
    assert [c.name for c in turn.calls] == ["ok"]
    assert len(turn.errors) == 1 and "no closing </tool_call>" in turn.errors[0]
    assert turn.content == "thinking..."


def test_a_long_malformed_call_is_quoted_short():
    turn = parse("<tool_call>{" + "x" * 10_000 + "</tool_call>")
    assert len(turn.errors[0]) < 300 and turn.errors[0].endswith("...")


def test_text_without_calls_is_all_content_and_a_stray_end_tag_stays_in_it():
    text = "<think>no tools needed</think>The answer is 4. </tool_call>"
    assert parse(text) == parsers.ParsedTurn(content=text.strip())


def test_assistant_message_has_the_shape_chat_templates_take():
    turn = parse('Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert turn.assistant_message() == {
        "role": "assistant",
        "content": "Sure.",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
        ],
    }
    assert "tool_calls" not in parse("plain").assistant_message()


def test_parsers_are_a_named_choice():
    assert isinstance(parsers.get_parser(), HermesParser)
    assert isinstance(parsers.get_parser("hermes"), HermesParser)
    assert isinstance(parsers.get_parser("grpo_rollout.tools.parsers:HermesParser"), HermesParser)
    with pytest.raises(ValueError, match=r"tool-call parser 'mistral' is neither a built-in \['hermes'\]"):
        parsers.get_parser("mistral")
    # Hermes turns end at the model's EOS; stopping at </tool_call> would cut parallel calls.
    assert parsers.get_parser().stop_strings() == []


def test_the_default_parser_is_registered():  # the set: test_mirrors.py
    assert parsers.DEFAULT_PARSER in parsers.PARSERS
