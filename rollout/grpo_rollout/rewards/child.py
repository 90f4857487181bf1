"""The reward worker process: `python -m grpo_rollout.rewards.child MEMORY_BYTES`, started by the worker.

`grpo_rollout.rewards.worker.PluginWorker` starts it (built-ins and plugins alike run here) in a
session of its own, with an environment that holds no token. Before it imports any reward it
confines itself: a data-memory limit, no core dumps, and child-subreaper status so that processes a
reward spawns stay below it (even after their parent exits) and the parent's kill finds them.

It reads one JSON request per line from stdin and answers one JSON line; stdout is moved to stderr
first, so a reward that prints cannot corrupt the answers. JSON, not pickle: the parent must never
unpickle what code it does not trust sends. It imports only the standard library, `base` and the
rewards themselves, so a fresh worker starts fast.
"""

import ctypes
import json
import os
import resource
import signal
import sys
from typing import Any, BinaryIO

from grpo_rollout.rewards.base import load_function

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
MAX_ERROR_CHARS = 2000  # a reward's error message, as it appears in the sample's reward details


def confine(memory_bytes: int) -> int:
    """Limit this process before any reward code runs; returns the memory limit applied.

    Hard limits equal soft ones, so a reward cannot raise them. RLIMIT_DATA, not RLIMIT_AS: it
    counts what a process can write to (heap, anonymous mappings, thread stacks), not the address
    space libraries only reserve, which for torch alone is over 3 GiB and for a CUDA context far
    more, so a reward that imports them still starts.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)  # a container may already hold it lower
    limit = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    return limit


def answer(request: dict[str, Any], functions: dict[str, Any], memory_bytes: int) -> dict[str, Any]:
    """Run one request; every failure of the reward becomes {"ok": false, "error": ...}."""
    try:
        path = request["path"]
        fn = functions.get(path) or functions.setdefault(path, load_function(path))
        if request["prompts"] is None:  # a load check only
            return {"ok": True, "scores": []}
        scores = fn(request["prompts"], request["completions"], **request["columns"])
        return {"ok": True, "scores": [None if v is None else float(v) for v in scores]}
    except MemoryError:
        limit = memory_bytes >> 20
        return {"ok": False, "error": f"MemoryError: over the reward worker's {limit} MiB memory limit"}
    except BaseException as e:  # anything the reward does wrong is reported, never ends the loop
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]}


def serve(requests: BinaryIO, answers: BinaryIO, memory_bytes: int) -> None:
    functions: dict[str, Any] = {}
    for line in requests:
        result = answer(json.loads(line), functions, memory_bytes)
        answers.write(json.dumps(result).encode() + b"\n")
        answers.flush()


def main(argv: list[str]) -> None:
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)  # print() in a reward goes to the server's log, not into the answers
    serve(requests, answers, confine(int(argv[1])))
    # The server is gone (EOF): take down anything a reward left running in this process group.
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv)
