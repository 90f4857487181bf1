"""What the reward worker process may see and use, and a kill that takes it whole: the parent's side.

`grpo_rollout.rewards.worker` starts `grpo_rollout.rewards.child` with `child_env()` and the
`memory_limit()` the child applies to itself, and ends it with `kill_tree()`. The threat is a
reward that misbehaves because of what the model wrote (a reward that runs generated code, a parser
fed a pathological answer) or because it is buggy: it must not starve the rollout server of memory,
outlive its call, or read the rollout token. It is not a wall against a deliberately hostile plugin,
which runs as the server's user in the server's pod: the pod is that wall.
"""

import os
import re
import signal
import subprocess
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path

from grpo_operator.api.contract import ENV_TOKEN

MEMORY_ENV = "GRPO_REWARD_MEMORY_MB"
# Writable memory (RLIMIT_DATA) of the worker and, each, of the processes it starts. Text rewards
# need tens of MiB; 4 GiB leaves room for sympy, numpy or a small CPU model while a runaway reward
# fails with MemoryError long before it can push the rollout server out of its pod's memory.
DEFAULT_MEMORY_MB = 4096
# Names of variables a reward never sees: the job token, and anything that looks like a secret.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE_?KEY|ACCESS_?KEY", re.I)
# Native thread pools stay at one thread: each thread's stack and buffers count against the memory
# limit, and the worker should not compete with the engine for cores.
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MAX_KILL_PASSES = 100  # each pass kills every process it saw; a fork bomb cannot outrun that for long


def child_env(parent: Mapping[str, str], sys_path: list[str]) -> dict[str, str]:
    """The worker's environment: the parent's minus secrets, with the parent's import path."""
    env = {k: v for k, v in parent.items() if k != ENV_TOKEN and not SECRET_NAME.search(k)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys_path if p)  # plugins import as in the server
    return env | SINGLE_THREADED


def memory_limit(env: Mapping[str, str]) -> int:
    """Bytes of writable memory for the worker, from $GRPO_REWARD_MEMORY_MB (MiB, default 4096)."""
    raw = env.get(MEMORY_ENV, str(DEFAULT_MEMORY_MB))
    if not raw.isdigit() or not 64 <= int(raw) <= 1 << 30:
        raise ValueError(f"${MEMORY_ENV} must be a whole number of MiB, at least 64; got {raw!r}")
    return int(raw) << 20


def live_descendants(pid: int) -> list[int]:
    """Processes below `pid` in the process tree, zombies left out, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):  # exited while we read
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the worker, everything it started, and its process group; then reap it.

    The worker is stopped first so it starts nothing new, and it is a child subreaper, so a process
    whose parent dies (or that left the session with setsid) is handed to it and found by the next
    pass. The process group catches what is left once the worker itself has died.
    """
    proc.send_signal(signal.SIGSTOP)  # a no-op once it is reaped, so never a reused pid
    for _ in range(MAX_KILL_PASSES):
        pids = live_descendants(proc.pid) if proc.poll() is None else []
        if not pids:
            break
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


def kill_new_descendants(before: set[int]) -> None:
    """SIGKILL the processes below this one that are not in `before`, and reap those that are its children.

    For a child subreaper (the worker) after a call that starts processes of its own: what the call
    orphaned, even in a session of its own, was handed to the worker, so it is found here.
    """
    killed: set[int] = set()
    for _ in range(MAX_KILL_PASSES):
        pids = [pid for pid in live_descendants(os.getpid()) if pid not in before]
        if not pids:
            break
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
    for pid in killed:
        with suppress(ChildProcessError):  # not ours to reap: its own parent, or init, does
            os.waitpid(pid, 0)
