"""A child process that runs user reward plugins, so one that hangs can be killed and replaced.

The scorer (`grpo_rollout.rewards.scorer`) sends it one batch call at a time over a pipe and waits
at most the job's reward timeout; on a timeout it kills the process and starts a fresh one on the
next call. A plugin that raises, or returns something that is not a list of numbers, comes back as
a PluginError carrying the plugin's own message. The child imports only this module and the plugin.
"""

import multiprocessing
import multiprocessing.connection
import threading
from typing import Any

from grpo_rollout.rewards.base import load_function


class PluginError(Exception):
    """The plugin raised or answered garbage; the message says which and why."""


class PluginTimeout(Exception):
    """The plugin did not answer in time; its worker was killed."""


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """Child main loop: (path, prompts, completions, columns) in, (ok, scores | reason) out."""
    functions: dict[str, Any] = {}
    while True:
        try:
            path, prompts, completions, columns = conn.recv()
        except EOFError:
            return
        try:
            fn = functions.get(path) or functions.setdefault(path, load_function(path))
            if prompts is None:  # a load check only
                conn.send((True, []))
                continue
            scores = fn(prompts, completions, **columns)
            conn.send((True, [None if v is None else float(v) for v in scores]))
        except BaseException as e:  # anything the plugin does wrong is reported, never kills the loop
            conn.send((False, f"{type(e).__name__}: {e}"))


class PluginWorker:
    """One plugin process, started lazily, killed on timeout, restarted on the next call."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._lock = threading.Lock()
        self.killed = 0  # workers killed after a timeout or death; the next call starts a fresh one

    def _ensure(self) -> multiprocessing.connection.Connection:
        if self._proc is None or not self._proc.is_alive():
            self.kill()
            parent, child = self._ctx.Pipe()
            self._proc = self._ctx.Process(
                target=_serve, args=(child,), name="grpo-reward-plugins", daemon=True
            )
            self._proc.start()
            child.close()
            self._conn = parent
        assert self._conn is not None
        return self._conn

    def kill(self) -> None:
        if self._proc is not None:
            self.killed += 1
            self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def call(
        self,
        path: str,
        prompts: list[str] | None,
        completions: list[str] | None,
        columns: dict[str, list[Any]],
        timeout: float,
    ) -> list[float | None]:
        """Run one batch call; PluginTimeout after `timeout` seconds (the worker is then killed)."""
        with self._lock:
            conn = self._ensure()
            try:
                conn.send((path, prompts, completions, columns))
                ready = conn.poll(timeout)
            except (OSError, EOFError) as e:
                self.kill()
                raise PluginError(f"reward worker died: {e}") from None
            if not ready:
                self.kill()
                raise PluginTimeout(f"timed out after {timeout:g}s; worker killed")
            try:
                ok, payload = conn.recv()
            except (OSError, EOFError):
                self.kill()
                raise PluginError(
                    "reward worker died during the call (crash or os._exit in the plugin)"
                ) from None
        if not ok:
            raise PluginError(payload)
        return payload

    def check(self, path: str, timeout: float = 60.0) -> None:
        """Import a plugin in the worker now, so a bad path fails at server start, not mid-job."""
        self.call(path, None, None, {}, timeout)
