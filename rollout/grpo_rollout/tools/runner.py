"""Runs a turn's tool calls in sandbox workers and turns each outcome into the text of a `tool` message.

The rollout loop builds one `ToolRunner` per job (its tools, by built-in name or 'module:function')
and, after each assistant turn, calls `run_turn(parser.parse(text))`. Every call runs in a
`PluginWorker` child, the reward sandbox: a call that hangs past `timeout` has its worker killed (the
next call starts a fresh one), and memory, environment and processes are confined as for rewards.
Nothing a call does, or a malformed call the model wrote, raises out of here: each becomes an
"error: ..." result the model reads back, counted in `ToolResults.errors`.
"""

import json
import queue
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from grpo_rollout.rewards.child import cap
from grpo_rollout.rewards.worker import PluginError, PluginTimeout, PluginWorker
from grpo_rollout.tools import registry
from grpo_rollout.tools.parsers import ParsedTurn, ToolCall

DEFAULT_TIMEOUT_S = 10.0  # per call; the reward timeout's default (spec.reward.timeoutSeconds)
# Per result: what a tool returns lands in the context of the model's next turn, so it is cut with a
# visible marker rather than let one call fill the context window.
DEFAULT_MAX_RESULT_CHARS = 4096
START_TIMEOUT_S = 60.0  # loading a tool and describing it (imports transformers) at start-up


@dataclass(frozen=True)
class ToolResult:
    content: str  # the tool message's text: the result, or "error: ..."
    error: bool
    name: str | None = None  # None for a call too malformed to have one
    call_id: str | None = None

    def message(self) -> dict[str, Any]:
        """The `tool` message a chat template takes."""
        msg: dict[str, Any] = {"role": "tool", "content": self.content}
        if self.name is not None:
            msg["name"] = self.name
        if self.call_id is not None:
            msg["tool_call_id"] = self.call_id
        return msg


@dataclass
class ToolResults:
    results: list[ToolResult] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return sum(r.error for r in self.results)

    def messages(self) -> list[dict[str, Any]]:
        return [r.message() for r in self.results]


class ToolRunner:
    """A job's tools, described for the chat template and called in sandbox workers."""

    def __init__(
        self,
        tools: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
        workers: int = 1,
        memory_bytes: int | None = None,
    ) -> None:
        """Load and describe every tool now, so a bad path or an undocumented tool fails at start-up.

        `workers` sandbox processes serve calls from that many threads at once (a rollout server runs
        many samples' turns concurrently); a turn's own calls run one after the other, in order.
        """
        if timeout <= 0 or max_result_chars <= 0 or workers < 1:
            raise ValueError("timeout and max_result_chars must be positive, workers at least 1")
        self.timeout, self.max_result_chars, self.workers = timeout, max_result_chars, workers
        self._workers: queue.LifoQueue[PluginWorker] = queue.LifoQueue()  # LIFO: a warm worker first
        for _ in range(workers):
            self._workers.put(PluginWorker(memory_bytes, label="tool worker"))
        self.paths: dict[str, str] = {}  # the name the model calls -> built-in name or 'module:function'
        self.schemas: list[dict[str, Any]] = []  # for apply_chat_template(tools=...), in the job's order
        try:
            for i, path in enumerate(tools):
                name = registry.tool_name(path)
                if name in self.paths:
                    raise ValueError(f"tools[{i}] {path!r}: a second tool named {name!r}")
                with self._worker() as worker:
                    try:
                        self.schemas.append(worker.describe_tool(path, name, START_TIMEOUT_S))
                    except (PluginError, PluginTimeout) as e:
                        raise ValueError(f"tools[{i}] {path!r}: {e}") from None
                self.paths[name] = path
        except BaseException:
            self.close()
            raise

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def close(self) -> None:
        """Kill the worker processes (a later call starts fresh ones)."""
        for worker in list(self._workers.queue):
            worker.kill()

    def call(self, call: ToolCall) -> ToolResult:
        """One call's result; every failure is an "error: ..." result, never an exception."""
        path = self.paths.get(call.name)
        if path is None:
            return self._error(call, f"unknown tool {call.name!r}; the tools are {self.names}")
        try:
            json.dumps(call.arguments)  # the parser's calls always are; a hand-made one may not be
            with self._worker() as worker:
                content = worker.call_tool(
                    path, call.name, call.arguments, self.timeout, self.max_result_chars
                )
        except PluginTimeout:
            return self._error(call, f"TimeoutError: tool {call.name!r} took longer than {self.timeout:g}s")
        except PluginError as e:
            return self._error(call, str(e))
        except (TypeError, ValueError, RecursionError) as e:
            return self._error(call, f"TypeError: arguments of tool {call.name!r} are not JSON: {e}")
        return ToolResult(content, error=False, name=call.name, call_id=call.id)

    def run(self, calls: Sequence[ToolCall]) -> ToolResults:
        return ToolResults([self.call(c) for c in calls])

    def run_turn(self, turn: ParsedTurn) -> ToolResults:
        """The turn's calls, then one error result per malformed call, so the model sees what went wrong."""
        results = self.run(turn.calls)
        results.results += [ToolResult(f"error: {e}", error=True) for e in turn.errors]
        return results

    def _error(self, call: ToolCall, message: str) -> ToolResult:
        return ToolResult(cap(f"error: {message}", self.max_result_chars), True, call.name, call.id)

    @contextmanager
    def _worker(self) -> Iterator[PluginWorker]:
        worker = self._workers.get()
        try:
            yield worker
        finally:
            self._workers.put(worker)
