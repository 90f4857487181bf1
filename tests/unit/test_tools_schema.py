"""Tool schemas (grpo_rollout.tools.schema) through a chat template; errors for tools it cannot describe.

The template below is written in the layout of Qwen2.5's tool template (tools as JSON lines in the system
turn, calls in <tool_call> tags, results in <tool_response>), rendered by transformers' own renderer: a
schema, an assistant turn's calls and the runner's tool messages all go through it, and the parser reads
back exactly the calls the template wrote.
"""

import json
import subprocess
import sys

import pytest
from grpo_rollout.tools import registry, schema
from grpo_rollout.tools.builtin.calculator import calculator
from grpo_rollout.tools.builtin.python_exec import python
from grpo_rollout.tools.parsers import HermesParser, ToolCall
from grpo_rollout.tools.runner import ToolResult
from transformers.utils.chat_template_utils import render_jinja_template

TEMPLATE = """
{%- if tools %}<|im_start|>system
You are a helpful assistant.

# Tools

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Call a function as <tool_call>{"name": <function-name>, "arguments": <args-object>}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for tc in m.tool_calls | default([]) %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def get_weather(city: str, unit: str = "celsius", days: int | None = None) -> dict:
    """Get the weather forecast for a city.

    Args:
        city: The city's name, e.g. "Paris".
        unit: The temperature unit. (choices: ["celsius", "fahrenheit"])
        days: How many days ahead; today when left out.
    """
    return {"city": city}


def test_a_documented_function_gives_the_openai_function_schema():
    assert schema.function_schema(get_weather) == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": 'The city\'s name, e.g. "Paris".'},
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": "The temperature unit.",
                    },
                    "days": {
                        "type": "integer",
                        "nullable": True,
                        "description": "How many days ahead; today when left out.",
                    },
                },
                "required": ["city"],
            },
            "return": {"type": "object"},
        },
    }
    assert schema.function_schema(get_weather, name="weather")["function"]["name"] == "weather"


def test_schemas_and_a_whole_tool_turn_render_through_a_chat_template():
    tools = [schema.function_schema(get_weather), schema.function_schema(calculator)]
    call = ToolCall("get_weather", {"city": "Paris", "days": 2}, "call_0")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call.as_dict()]},
        ToolResult('{"city": "Paris"}', error=False, name="get_weather", call_id="call_0").message(),
    ]
    (text,), _ = render_jinja_template(
        [messages], tools=tools, chat_template=TEMPLATE, add_generation_prompt=True
    )
    for tool in tools:  # each schema, as the model reads it
        assert json.dumps(tool, ensure_ascii=False) in text
    assert '"enum": ["celsius", "fahrenheit"]' in text
    assert '<tool_response>\n{"city": "Paris"}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # What the template wrote for the assistant's call is what the parser reads back.
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = HermesParser().parse(turn)
    assert parsed.calls == [call] and parsed.errors == [] and parsed.content == "Checking."


def test_the_built_in_tools_are_registered_under_their_names():  # the set: test_mirrors.py
    assert registry.BUILTINS.get("calculator") is calculator and registry.BUILTINS.get("python") is python


def test_the_built_in_tools_describe_themselves():
    for fn, arg in ((calculator, "expression"), (python, "code")):
        described = schema.function_schema(fn)["function"]
        assert described["name"] == fn.__name__
        assert described["description"]
        assert described["parameters"]["required"] == [arg]
        assert described["parameters"]["properties"][arg]["type"] == "string"


def no_docstring(x: int) -> int:
    return x


def untyped(x):
    """Untyped.

    Args:
        x: an x
    """


def undocumented_argument(x: int, y: int) -> int:
    """Adds.

    Args:
        x: an x
    """
    return x + y


def star_args(*values: int) -> int:
    """Sums.

    Args:
        values: the values
    """
    return sum(values)


def summary_missing() -> int:
    """Args:"""
    return 1


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        (no_docstring, "has no docstring"),
        (untyped, "Argument x is missing a type hint"),
        (undocumented_argument, "no description for the argument 'y'"),
        (star_args, r"arguments \['values'\] are \*args, \*\*kwargs or positional-only"),
        (summary_missing, "no summary line"),
        (len, "no inspectable signature|positional-only"),
    ],
)
def test_a_tool_the_template_cannot_describe_names_its_path_and_what_is_missing(fn, error):
    with pytest.raises(ValueError, match=error) as e:
        schema.function_schema(fn, path="my_pkg.tools:thing")
    assert str(e.value).startswith("tool 'my_pkg.tools:thing': ")


def test_a_schema_never_costs_a_torch_import():
    code = (
        "import sys; from grpo_rollout.tools import schema; from grpo_rollout.tools.builtin import calculator"
        "; schema.function_schema(calculator.calculator); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_check_schema_takes_the_openai_shape_and_names_what_is_wrong():
    good = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    assert schema.check_schema(good, "f") is good
    assert schema.check_schema({"type": "function", "function": {"name": "f"}}, "f")
    for bad, error in [
        ({"name": "f"}, 'must be {"type": "function"'),
        ({"type": "function", "function": {"name": ""}}, "function.name"),
        ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}, "parameters"),
    ]:
        with pytest.raises(ValueError, match=error):
            schema.check_schema(bad, "pkg:f")
