"""A child process that runs rewards and tools, so one that hangs, bloats or crashes is killed and replaced.

The scorer (`grpo_rollout.rewards.scorer`) sends it one batch call at a time and waits at most the
job's reward timeout, and `grpo_rollout.tools.runner` one tool call at a time; on a timeout it kills
the process with everything it started and starts a fresh one on the next call. The child
(`grpo_rollout.rewards.child`) is confined as `grpo_rollout.rewards.sandbox` describes. Requests and
answers are JSON lines over its stdin and stdout, written and read against the call's deadline, and
an answer may be no larger than what it carries needs (scores, a capped tool result): what the child
sends is parsed as data, never unpickled. A function that raises, or answers with the wrong shape,
comes back as a PluginError carrying the function's own message. A reward's `Unjudged` scores (no
verdict, out of time) come back as `Unjudged` in the scores' list. The rewards `check` loaded are loaded
again, with their warm-ups, into every fresh process before its first call, on the load's time.
"""

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from grpo_rollout.rewards import child, sandbox
from grpo_rollout.rewards.base import Unjudged


class PluginError(Exception):
    """The plugin raised or answered garbage; the message says which and why."""


class PluginTimeout(Exception):
    """The plugin did not answer in time; its worker was killed."""


ANSWER_BASE_BYTES = 8192  # the JSON frame and an error message (the child cuts those at 2000 chars)
ANSWER_BYTES_PER_SCORE = 32  # a float's repr and its separator
# an Unjudged score's [index, reason]: JSON writes a character as at most 12 bytes (a surrogate pair)
ANSWER_BYTES_PER_UNJUDGED = 32 + 12 * child.MAX_REASON_CHARS
LOAD_TIMEOUT_S = 60.0  # importing (and warming) a reward in the worker: at start-up, never a batch's time
TOOL_SCHEMA_BYTES = 1 << 20  # a tool's description for the chat template; a real one is a few KiB


class PluginWorker:
    """One sandbox process (rewards, tools), started lazily, killed on timeout, restarted on the next call."""

    def __init__(self, memory_bytes: int | None = None, label: str = "reward worker") -> None:
        self.label = label  # how errors name it: "reward worker" or "tool worker"
        self.memory_bytes = memory_bytes or sandbox.memory_limit(os.environ)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        # the rewards `check` loaded: a fresh process loads them (and warms them) before its first call
        self._loaded: list[str] = []
        self.killed = 0  # workers killed after a timeout or death; the next call starts a fresh one

    def _ensure(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self.kill()
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "grpo_rollout.rewards.child", str(self.memory_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=sandbox.child_env(os.environ, sys.path),
                start_new_session=True,  # its own session and process group, away from the server's
            )
            assert self._proc.stdin is not None
            os.set_blocking(self._proc.stdin.fileno(), False)  # writes wait on the deadline, not the child
            for path in self._loaded:
                self._send(self._proc, load_request(path), "scores", list, LOAD_TIMEOUT_S, ANSWER_BASE_BYTES)
        return self._proc

    def kill(self) -> None:
        if self._proc is not None:
            self.killed += 1
            sandbox.kill_tree(self._proc)
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc = None

    def call(
        self,
        path: str,
        prompts: list[str] | None,
        completions: list[str] | None,
        columns: dict[str, list[Any]],
        timeout: float,
    ) -> list[float | None]:
        """Run one batch call; PluginTimeout after `timeout` seconds (the worker is then killed).
        A score the reward returned as `Unjudged` comes back as one, with its reason."""
        request = {"path": path, "prompts": prompts, "completions": completions, "columns": columns}
        per_score = ANSWER_BYTES_PER_SCORE + ANSWER_BYTES_PER_UNJUDGED
        limit = ANSWER_BASE_BYTES + per_score * len(completions or ())
        return self.request(request, "scores", list, timeout, limit)

    def check(self, path: str, timeout: float = LOAD_TIMEOUT_S) -> None:
        """Import (and warm) a reward in the worker now, so a bad path fails at server start, not mid-job;
        every later fresh process loads it again before its first call."""
        self.request(load_request(path), "scores", list, timeout, ANSWER_BASE_BYTES)
        if path not in self._loaded:
            self._loaded.append(path)

    def call_tool(
        self, path: str, name: str, arguments: dict[str, Any], timeout: float, max_chars: int
    ) -> str:
        """One tool call: its result as text of at most `max_chars` characters (and a truncation marker)."""
        request = {"op": "tool", "path": path, "name": name, "arguments": arguments, "timeout": timeout}
        request["max_chars"] = max_chars
        # JSON writes a character as at most 12 bytes (a surrogate pair); an error may take MAX_ERROR_CHARS
        limit = ANSWER_BASE_BYTES + 12 * (max_chars + child.MAX_ERROR_CHARS)
        return self.request(request, "result", str, timeout, limit)

    def describe_tool(self, path: str, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Import a tool in the worker and return its schema for the chat template (`tools.schema`)."""
        request = {"op": "describe", "path": path, "name": name}
        return self.request(request, "schema", dict, timeout, ANSWER_BASE_BYTES + TOOL_SCHEMA_BYTES)

    def request(self, request: dict[str, Any], key: str, kind: type, timeout: float, limit: int) -> Any:
        """Send one request, return its answer's `key` (a `kind`); PluginError or PluginTimeout otherwise."""
        with self._lock:
            return self._send(self._ensure(), request, key, kind, timeout, limit)

    def _send(
        self,
        proc: subprocess.Popen[bytes],
        request: dict[str, Any],
        key: str,
        kind: type,
        timeout: float,
        limit: int,
    ) -> Any:
        line = json.dumps(request).encode() + b"\n"
        try:
            raw = exchange(proc, line, time.monotonic() + timeout, limit, self.label)
        except PluginTimeout:
            self.kill()
            raise PluginTimeout(f"timed out after {timeout:g}s; worker killed") from None
        except PluginError:
            self.kill()
            raise
        try:  # only code that wrote to the answer channel itself gets past this as garbage
            answer = json.loads(raw)
            ok = answer["ok"] is True
            payload = answer[key] if ok else str(answer["error"])
            if ok and not isinstance(payload, kind):
                raise TypeError
            if ok and key == "scores":
                payload = with_unjudged(payload, answer.get("unjudged", []))
        except (ValueError, TypeError, KeyError, IndexError, RecursionError):
            self.kill()
            raise PluginError(f"{self.label} answered garbage: {raw[:80]!r}") from None
        if not ok:
            raise PluginError(payload)
        return payload


def load_request(path: str) -> dict[str, Any]:
    """The request that only loads a reward (and runs its warm-up)."""
    return {"path": path, "prompts": None, "completions": None, "columns": {}}


def with_unjudged(scores: list[Any], unjudged: Any) -> list[Any]:
    """`scores` with each [index, reason] in `unjudged` made an Unjudged; TypeError, ValueError or
    IndexError when it is malformed."""
    if not isinstance(unjudged, list):
        raise TypeError
    out = list(scores)
    for item in unjudged:
        i, reason = item
        if (
            not isinstance(i, int)
            or isinstance(i, bool)
            or not isinstance(reason, str)
            or not 0 <= i < len(out)
        ):
            raise IndexError
        out[i] = Unjudged(reason)
    return out


def exchange(
    proc: subprocess.Popen[bytes], request: bytes, deadline: float, limit: int, who: str = "reward worker"
) -> bytes:
    """Write one request line and read one answer line, both before `deadline`.

    PluginTimeout when the deadline passes; PluginError when the child dies, answers more than
    `limit` bytes, or sends anything after its answer line.
    """
    assert proc.stdin is not None and proc.stdout is not None
    out, inp = proc.stdin.fileno(), proc.stdout.fileno()
    poller = select.poll()  # not select.select: the server's descriptors may be numbered past 1024
    pending = memoryview(request)
    poller.register(out, select.POLLOUT)
    while pending:
        wait_for(poller, deadline)
        try:
            pending = pending[os.write(out, pending) :]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            raise PluginError(f"{who} died before it read the call") from None
    poller.unregister(out)
    poller.register(inp, select.POLLIN)
    answer = bytearray()
    while not answer.endswith(b"\n"):
        wait_for(poller, deadline)
        chunk = os.read(inp, 1 << 16)
        if not chunk:
            raise PluginError(f"{who} died during the call (a crash or os._exit; see the server log)")
        answer += chunk
        if len(answer) > limit or b"\n" in answer[:-1]:
            raise PluginError(f"{who} answered more than one line of at most {limit} bytes")
    return bytes(answer)


def wait_for(poller: select.poll, deadline: float) -> None:
    """Until the polled descriptor is ready (or closed); PluginTimeout at the deadline."""
    left = deadline - time.monotonic()
    if left <= 0 or not poller.poll(left * 1000):
        raise PluginTimeout
