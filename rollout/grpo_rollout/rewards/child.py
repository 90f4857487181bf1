"""The sandbox worker process: `python -m grpo_rollout.rewards.child MEMORY_BYTES`, started by the worker.

`grpo_rollout.rewards.worker.PluginWorker` starts it (rewards and tools, built-ins and plugins alike run
here, for the scorer and for `grpo_rollout.tools.runner.ToolRunner`) in a
session of its own, with an environment that holds no token. Before it imports any reward it
confines itself: a data-memory limit, no core dumps, and child-subreaper status so that processes a
reward spawns stay below it (even after their parent exits) and the parent's kill finds them.

It reads one JSON request per line from stdin and answers one JSON line; stdout is moved to stderr
first, so a reward that prints cannot corrupt the answers. JSON, not pickle: the parent must never
unpickle what code it does not trust sends. A request's "op" says what to do: "score" (the default:
a reward's batch call), "tool" (one tool call), "describe" (a tool's schema for the chat template), or
"env_check", "env_reset", "env_step", "env_close" for `grpo_rollout.environments`: environment instances
live in this process between requests, in `grpo_rollout.environment_host.EpisodeHost`.
It imports only the standard library, the loaders and what a request names (a registry imports every
built-in of the kind named: they are kept cheap to import), so a fresh worker starts fast (transformers,
for a schema, only when asked for one).
"""

import ctypes
import inspect
import io
import json
import os
import resource
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Any, BinaryIO

from grpo_rollout import environment_host
from grpo_rollout.environment_host import EnvError, EpisodeHost
from grpo_rollout.rewards.base import Unjudged, load_function, warm_up
from grpo_rollout.tools import registry, schema

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
MAX_ERROR_CHARS = 2000  # a reward's error message, as it appears in the sample's reward details
MAX_REASON_CHARS = 200  # an Unjudged score's reason, per sample


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


def answer(
    request: dict[str, Any], functions: dict[str, Any], memory_bytes: int, host: EpisodeHost
) -> dict[str, Any]:
    """Run one request; every failure of a reward, tool or environment becomes {"ok": false, "error": ...}."""
    op = request.get("op", "score")
    try:
        if op.startswith("env_"):
            return {"ok": True, "result": call_environment(op, request, functions, host)}
        if op == "tool":
            return call_tool(request, functions)
        if op == "describe":
            fn = load(functions, request["path"], tool=True)
            return {
                "ok": True,
                "schema": schema.function_schema(fn, name=request["name"], path=request["path"]),
            }
        fn = load(functions, request["path"])
        if request["prompts"] is None:  # a load check only
            return {"ok": True, "scores": []}
        return scored(fn(request["prompts"], request["completions"], **request["columns"]))
    except MemoryError:
        who = "reward" if op == "score" else "environment" if op.startswith("env_") else "tool"
        limit = memory_bytes >> 20
        return {"ok": False, "error": f"MemoryError: over the {who} worker's {limit} MiB memory limit"}
    except EnvError as e:  # already says which method did what wrong
        return {"ok": False, "error": str(e)[:MAX_ERROR_CHARS]}
    except BaseException as e:  # anything the reward does wrong is reported, never ends the loop
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]}


def scored(scores: Any) -> dict[str, Any]:
    """A reward's answer: its scores as floats (None kept), and [index, reason] of each Unjudged one."""
    values = [None if v is None else float(v) for v in scores]
    unjudged = [[i, v.reason[:MAX_REASON_CHARS]] for i, v in enumerate(scores) if isinstance(v, Unjudged)]
    return {"ok": True, "scores": values, "unjudged": unjudged}


def load(functions: dict[str, Any], path: str, tool: bool = False, environment: bool = False) -> Any:
    """A reward, tool or environment class by path, imported once per worker (a reward's warm-up run then)."""
    key = f"{'env:' * environment}{path}"  # a class is checked as one, apart from a function
    if key not in functions:
        if environment:
            functions[key] = environment_host.load_class(path)
        elif tool:
            functions[key] = registry.load_tool(path)
        else:
            fn = load_function(path)
            warm_up(fn)  # on the load's time, not a batch's: a worker loads what the scorer checked first
            functions[key] = fn
    return functions[key]


def call_environment(
    op: str, request: dict[str, Any], functions: dict[str, Any], host: EpisodeHost
) -> dict[str, Any]:
    """One environment request; what user code prints reaches the log cut, as a tool's does."""
    if op == "env_close":
        host.close(request["episode"])
        return {}
    if op == "env_step":
        with printing_capped(f"environment step of episode {request['episode']!r}"):
            return host.step(request["episode"], request["messages"], request["max_chars"])
    path, args = request["path"], request["args"]
    cls = load(functions, path, environment=True)
    if op == "env_check":  # at start-up: the class imports and has its methods (and takes the args)
        if args is not None:
            environment_host.check_args(cls, args, path)
        return {}
    if op != "env_reset":
        raise ValueError(f"unknown op {op!r}")
    with printing_capped(f"environment reset of episode {request['episode']!r}"):
        return {"messages": host.reset(cls, args, request["episode"], request["row"], request["max_chars"])}


def call_tool(request: dict[str, Any], functions: dict[str, Any]) -> dict[str, Any]:
    """One tool call: its result as text for a `tool` message, cut to the request's max_chars.

    What the tool prints goes to the server log, cut to MAX_ERROR_CHARS: a tool runs once per call of
    every sample, and one that prints megabytes must not flood the log.
    """
    name, fn = request["name"], load(functions, request["path"], tool=True)
    try:
        inspect.signature(fn).bind(**request["arguments"])
    except TypeError as e:
        return {"ok": False, "error": f"TypeError: wrong arguments for tool {name!r}: {e}"}
    with registry.deadline(request["timeout"]), printing_capped(f"tool {name!r}"):
        value = fn(**request["arguments"])
    try:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        what = type(value).__name__
        return {"ok": False, "error": f"TypeError: tool {name!r} returned {what}, which is not JSON: {e}"}
    return {"ok": True, "result": cap(text, request["max_chars"])}


def cap(text: str, max_chars: int) -> str:
    """`text`, or its first `max_chars` characters and a marker the model can see."""
    cut = len(text) - max_chars
    return text if cut <= 0 else f"{text[:max_chars]}\n[truncated {cut} chars]"


@contextmanager
def printing_capped(who: str) -> Iterator[None]:
    """What the code inside prints, kept to MAX_ERROR_CHARS and written to the server log once, after it."""
    printed = CappedText(MAX_ERROR_CHARS)
    try:
        with redirect_stdout(printed), redirect_stderr(printed):
            yield
    finally:
        if printed.size:
            print(f"{who} printed {printed.size} chars: {printed.text()}", file=sys.stderr, flush=True)


class CappedText(io.TextIOBase):
    """A text stream that keeps the first `limit` characters written to it and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.size, self._kept = limit, 0, io.StringIO()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if self.size < self.limit:
            self._kept.write(s[: self.limit - self.size])
        self.size += len(s)
        return len(s)

    def text(self) -> str:
        return self._kept.getvalue() + ("..." if self.size > self.limit else "")


def serve(requests: BinaryIO, answers: BinaryIO, memory_bytes: int) -> None:
    functions: dict[str, Any] = {}
    host = EpisodeHost()  # environment instances, alive from their episode's reset to its end
    for line in requests:
        result = answer(json.loads(line), functions, memory_bytes, host)
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
