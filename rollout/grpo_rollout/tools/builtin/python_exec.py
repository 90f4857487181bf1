"""The `python` built-in tool: runs the model's program in a fresh `python -I` process and returns its output.

It runs inside the sandbox worker (`grpo_rollout.rewards.child`), so the program inherits the worker's
confinement: an environment without secrets, the worker's memory limit (a limit per process), no core
dumps, and the worker as its subreaper. The program gets an empty temporary directory, no stdin, and
time until just before the call's deadline; it is killed with all it started (`sandbox.kill_tree`) when it
runs out of time or prints more than MAX_OUTPUT_BYTES, and what it leaves running is killed when it ends.
"""

import os
import select
import subprocess
import sys
import tempfile
import time

from grpo_rollout.rewards import sandbox
from grpo_rollout.tools.registry import BUILTINS, time_left

MAX_OUTPUT_BYTES = 64 << 10  # kept from stdout+stderr; the runner cuts the tool's result further
DEFAULT_TIMEOUT_S = 10.0  # outside a timed call (a direct call in a test or a notebook)
MARGIN_S = 0.5  # the program is stopped this long before the worker's deadline, so its output gets back


@BUILTINS.register("python")
def python(code: str) -> str:
    """Run a Python 3 program in a fresh interpreter and return what it printed (stdout and stderr).

    Args:
        code: The program's source code. Use print() for every value you want to see.
    """
    left = time_left()
    timeout = DEFAULT_TIMEOUT_S if left is None else max(left - MARGIN_S, 0.1)
    before = set(sandbox.live_descendants(os.getpid()))
    with tempfile.TemporaryDirectory(prefix="grpo-python-tool-") as cwd:
        with open(os.path.join(cwd, "main.py"), "w") as f:  # a file, not -c: no argv size limit
            f.write(code)
        proc = subprocess.Popen(
            [sys.executable, "-I", "main.py"],  # -I: no PYTHONPATH, user site or cwd-first imports
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, for kill_tree
        )
        try:
            output, stopped = _read(proc, time.monotonic() + timeout)
        finally:
            sandbox.kill_tree(proc)
            sandbox.kill_new_descendants(before)  # what it left running, even in a session of its own
            proc.stdout.close()  # type: ignore[union-attr]
    text = output.decode(errors="replace")
    if stopped == "timeout":
        raise TimeoutError(
            f"the program ran longer than {timeout:.3g}s and was killed; its output so far:\n{text}"
        )
    if stopped == "flood":
        return f"{text}\n[output cut at {MAX_OUTPUT_BYTES} bytes; the program was killed]"
    if proc.returncode:
        return f"{text}\n[exit status {proc.returncode}]"
    return text


def _read(proc: subprocess.Popen[bytes], deadline: float) -> tuple[bytes, str | None]:
    """Its output until EOF; stopped early ("timeout", "flood") at the deadline or the output cap."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    output = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return bytes(output), "timeout"
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            try:  # EOF: it closed its output, so it is exiting (or it went on without one)
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                return bytes(output), "timeout"
            return bytes(output), None
        output += chunk
        if len(output) > MAX_OUTPUT_BYTES:
            return bytes(output[:MAX_OUTPUT_BYTES]), "flood"
