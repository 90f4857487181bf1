"""A child process that runs reward functions, so one that hangs, bloats or crashes is killed and replaced.

The scorer (`grpo_rollout.rewards.scorer`) sends it one batch call at a time and waits at most the
job's reward timeout; on a timeout it kills the process with everything it started and starts a
fresh one on the next call. The child (`grpo_rollout.rewards.child`) is confined as
`grpo_rollout.rewards.sandbox` describes. Requests and answers are JSON lines over its stdin and
stdout, written and read against the call's deadline, and an answer may be no larger than the
scores it carries need: what the child sends is parsed as data, never unpickled. A function that
raises, or returns something that is not a list of numbers, comes back as a PluginError carrying the
function's own message.
"""

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from grpo_rollout.rewards import sandbox


class PluginError(Exception):
    """The plugin raised or answered garbage; the message says which and why."""


class PluginTimeout(Exception):
    """The plugin did not answer in time; its worker was killed."""


ANSWER_BASE_BYTES = 8192  # the JSON frame and an error message (the child cuts those at 2000 chars)
ANSWER_BYTES_PER_SCORE = 32  # a float's repr and its separator


class PluginWorker:
    """One reward process, started lazily, killed on timeout, restarted on the next call."""

    def __init__(self, memory_bytes: int | None = None) -> None:
        self.memory_bytes = memory_bytes or sandbox.memory_limit(os.environ)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
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
        """Run one batch call; PluginTimeout after `timeout` seconds (the worker is then killed)."""
        request = {"path": path, "prompts": prompts, "completions": completions, "columns": columns}
        line = json.dumps(request).encode() + b"\n"
        limit = ANSWER_BASE_BYTES + ANSWER_BYTES_PER_SCORE * len(completions or ())
        with self._lock:
            proc = self._ensure()
            try:
                raw = exchange(proc, line, time.monotonic() + timeout, limit)
            except PluginTimeout:
                self.kill()
                raise PluginTimeout(f"timed out after {timeout:g}s; worker killed") from None
            except PluginError:
                self.kill()
                raise
            try:  # only a reward that wrote to the answer channel itself gets past this as garbage
                answer = json.loads(raw)
                ok = answer["ok"] is True
                payload = answer["scores"] if ok else str(answer["error"])
                if ok and not isinstance(payload, list):
                    raise TypeError
            except (ValueError, TypeError, KeyError, RecursionError):
                self.kill()
                raise PluginError(f"reward worker answered garbage: {raw[:80]!r}") from None
        if not ok:
            raise PluginError(payload)
        return payload

    def check(self, path: str, timeout: float = 60.0) -> None:
        """Import a reward in the worker now, so a bad path fails at server start, not mid-job."""
        self.call(path, None, None, {}, timeout)


def exchange(proc: subprocess.Popen[bytes], request: bytes, deadline: float, limit: int) -> bytes:
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
            raise PluginError("reward worker died before it read the call") from None
    poller.unregister(out)
    poller.register(inp, select.POLLIN)
    answer = bytearray()
    while not answer.endswith(b"\n"):
        wait_for(poller, deadline)
        chunk = os.read(inp, 1 << 16)
        if not chunk:
            raise PluginError("reward worker died during the call (a crash or os._exit; see the server log)")
        answer += chunk
        if len(answer) > limit or b"\n" in answer[:-1]:
            raise PluginError(f"reward worker answered more than one line of at most {limit} bytes")
    return bytes(answer)


def wait_for(poller: select.poll, deadline: float) -> None:
    """Until the polled descriptor is ready (or closed); PluginTimeout at the deadline."""
    left = deadline - time.monotonic()
    if left <= 0 or not poller.poll(left * 1000):
        raise PluginTimeout
