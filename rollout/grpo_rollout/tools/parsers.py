"""Tool-call parsers: the model's text of one assistant turn -> the calls it makes, as a named choice.

The rollout loop picks a parser by name (`get_parser`; the names in `PARSERS` are the API's) and calls
`parse(text)` on each finished turn. A malformed call is the model's mistake, part of what it learns
from: it comes back in `ParsedTurn.errors`, never as an exception.
"""

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from grpo_wire.registry import Registry

PARSERS: Registry[type["ToolCallParser"]] = Registry("tool-call parser", home="grpo_rollout.tools.parsers")
DEFAULT_PARSER = "hermes"
EXCERPT_CHARS = 120  # of a malformed call's text, quoted in its error so the model can see what it wrote


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    # Numbered in the turn's order (call_0, call_1, ...): a rollout must not depend on a random draw,
    # and the id only has to pair each call with its tool message within the turn.
    id: str

    def as_dict(self) -> dict[str, Any]:
        """An entry of an assistant message's `tool_calls`, as HF templates take it (arguments a dict)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedTurn:
    content: str  # the turn's text outside the calls, stripped; "" when the turn is only calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per malformed call, for the model to read

    def assistant_message(self) -> dict[str, Any]:
        """The turn as a chat message with `tool_calls`, for templates and for logs."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [c.as_dict() for c in self.calls]
        return message


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...

    def stop_strings(self) -> list[str]:
        """Strings at which generation of a turn must stop for this format (beyond the model's EOS)."""
        ...


@PARSERS.register("hermes")
class HermesParser:
    """Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

    A turn may hold several calls. Each body is decoded as one JSON value from its first character
    rather than cut at the next end tag, so a `</tool_call>` inside an argument string (code that
    prints one) does not split the call. `arguments` may be an object or a JSON string of one (some
    templates and fine-tunes write it double-encoded); a missing `arguments` means no arguments.
    """

    start, end = "<tool_call>", "</tool_call>"

    def stop_strings(self) -> list[str]:
        # None: the chat template closes the turn with the model's EOS (<|im_end|>), and stopping at
        # `</tool_call>` would cut the second of two parallel calls.
        return []

    def parse(self, text: str) -> ParsedTurn:
        outside: list[str] = []
        turn = ParsedTurn(content="")
        decoder = json.JSONDecoder()
        pos = 0
        while (start := text.find(self.start, pos)) >= 0:
            outside.append(text[pos:start])
            number = len(turn.calls) + len(turn.errors) + 1
            body = start + len(self.start)
            first = _skip_space(text, body)
            try:
                value, after = decoder.raw_decode(text, first)
            except json.JSONDecodeError as e:
                value, after, problem = None, first, f"invalid JSON ({e.msg} at char {e.pos - first})"
            else:
                problem = None
            close = _skip_space(text, after)
            if problem is None and text.startswith(self.end, close):
                pos = close + len(self.end)
                self._add(turn, value, number)
                continue
            end = text.find(self.end, body if problem else after)  # a decoded value owns its text
            excerpt = text[body : end if end >= 0 else len(text)].strip()
            if end < 0:
                problem = f"no closing {self.end} (the turn ended inside the call)"
                pos = len(text)
            else:
                problem = problem or f"text after the JSON object, before {self.end}"
                pos = end + len(self.end)
            turn.errors.append(f"tool call {number}: {problem}: {_excerpt(excerpt)}")
        outside.append(text[pos:])
        turn.content = "".join(outside).strip()
        return turn

    @staticmethod
    def _add(turn: ParsedTurn, value: Any, number: int) -> None:
        """Validate one decoded call body; a call, or an error that says what is wrong."""
        where = f"tool call {number}"
        if not isinstance(value, dict):
            turn.errors.append(
                f"{where}: expected a JSON object with 'name' and 'arguments', got {_kind(value)}"
            )
            return
        name = value.get("name")
        if not isinstance(name, str) or not name.strip():
            turn.errors.append(f"{where}: missing 'name' (a non-empty string): {_excerpt(json.dumps(value))}")
            return
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                turn.errors.append(f"{where} ({name}): 'arguments' is a string but not JSON ({e.msg})")
                return
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            turn.errors.append(f"{where} ({name}): 'arguments' must be a JSON object, got {_kind(arguments)}")
            return
        turn.calls.append(ToolCall(name=name.strip(), arguments=arguments, id=f"call_{len(turn.calls)}"))


def get_parser(name: str = DEFAULT_PARSER) -> ToolCallParser:
    """The parser registered under `name` (a built-in's name or 'module:Class'), constructed."""
    return PARSERS.load(name)()


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "null" if value is None else "a number"
    )


def _excerpt(text: str) -> str:
    return repr(text) if len(text) <= EXCERPT_CHARS else repr(text[:EXCERPT_CHARS]) + "..."
