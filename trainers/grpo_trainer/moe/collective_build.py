"""Building a collective object (a DeepEP buffer) on every rank of a group: bounded, and agreed.

DeepEP's buffer constructors are collective: `ElasticBuffer.__init__` exchanges handles and ends in
a barrier over the EP group (`deep_ep/buffers/elastic.py:338-367` at DEEPEP_COMMIT), and v1's
`Buffer` exchanges IPC handles likewise. When one rank fails inside (no NCCL GIN on its node, a
registration error), its peers wait in the next collective until the group's timeout (30 minutes,
`parallel.PG_TIMEOUT`), and nothing can unstick a rank blocked in an NCCL call. So every rank that
builds one goes through `build`:
- it runs the constructor under a watchdog; when it returns or raises, the rank says so in the
  default group's store (`done`, or `failed: <reason>`);
- then it waits, at most until `timeout_s` after it started, for every rank of the group to say the
  same. When all have, nobody is stuck: a local failure is raised as usual (`auto` then drops the
  candidate on every rank, as for any other failure);
- when some rank has not said it by then (still inside the constructor, or dead), or the
  watchdog sees this rank's own constructor still running then, the gang cannot go on: the rank
  ends its process (`EXIT_STUCK`) with every rank's verdict in the message and the termination log,
  so the job fails or restarts within `timeout_s` and says why, never after the group's timeout.
Each build gets its own keys (the n-th build of this process, the same on every rank: builds run
in the same order everywhere).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist
from grpo_operator.api.contract import write_termination_message

log = logging.getLogger(__name__)
T = TypeVar("T")
PREFIX = "grpo-collective-build"
TIMEOUT_S = float(os.environ.get("GRPO_COLLECTIVE_BUILD_TIMEOUT_S", "120"))
HOST_LINGER_S = 3.0  # rank 0's wait before it ends, so the others still read the verdicts from its store
EXIT_STUCK = 75  # a rank that cannot go on because a collective build did not finish on every rank
_builds = itertools.count()


def verdicts(store: dist.Store, prefix: str, ranks: list[int]) -> dict[int, str]:
    """What each rank said so far (rank -> "done" or "failed: ..."), the silent ones left out; what
    could be read when the store went away (its host, rank 0, ended)."""
    out: dict[int, str] = {}
    try:
        for r in ranks:
            key = f"{prefix}/{r}"
            if store.check([key]):
                out[r] = store.get(key).decode()
    except Exception as e:
        log.warning("reading the collective build's verdicts: %s", e)
    return out


def base_store(store: dist.Store) -> dist.Store:
    """The store under any PrefixStores (our keys carry a prefix of their own)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def own_client(store: dist.Store) -> dist.Store:
    """A client of our own to the same TCPStore: a TCPStore client runs one operation at a time, and
    the constructor may be blocked in one on the shared client."""
    if not isinstance(store, dist.TCPStore):
        return store  # a FileStore or HashStore: nothing blocks on it
    return dist.TCPStore(store.host, store.port, is_master=False, timeout=datetime.timedelta(seconds=30))


def stuck_message(what: str, ranks: list[int], said: dict[int, str], timeout_s: float) -> str:
    """Why the gang cannot go on (pure): who failed and why, who never finished."""
    silent = [r for r in ranks if r not in said]
    failed = [f"rank {r} {v}" for r, v in sorted(said.items()) if v != "done"]
    text = f"{what} did not finish on every rank within {timeout_s:.0f}s"
    if failed:
        text += ": " + "; ".join(failed)
    if silent:
        text += f"; ranks {silent} still inside it (a collective constructor cannot be interrupted)"
    return text + "; the gang stops instead of waiting for the process group's timeout"


def _stop(message: str) -> None:
    """End this rank's process: it is blocked, or its peers are, in a collective nothing can end.
    Rank 0 hosts the store the others read the verdicts from, so it ends last."""
    if dist.get_rank() == 0:
        time.sleep(HOST_LINGER_S)
    log.error("%s", message)
    print(f"grpo-trainer: {message}", file=sys.stderr, flush=True)
    write_termination_message(message, who="grpo-trainer")
    os._exit(EXIT_STUCK)


def build(
    what: str,
    group: dist.ProcessGroup | None,
    construct: Callable[[], T],
    *,
    timeout_s: float | None = None,
    store: dist.Store | None = None,
) -> T:
    """`construct()` on this rank, agreed with every rank of `group` (see the module docstring)."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    store = base_store(store if store is not None else dist.distributed_c10d._get_default_store())
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    prefix = f"{PREFIX}/{next(_builds)}"
    deadline = time.monotonic() + timeout_s
    returned = threading.Event()
    watcher = own_client(store)

    def watch() -> None:
        if not returned.wait(timeout_s):
            _stop(stuck_message(what, ranks, verdicts(watcher, prefix, ranks), timeout_s))

    threading.Thread(target=watch, name="collective-build-watch", daemon=True).start()
    error: Exception | None = None
    try:
        result = construct()
    except Exception as e:
        error = e
    returned.set()
    mine = "done" if error is None else f"failed: {type(error).__name__}: {error}"
    try:
        store.set(f"{prefix}/{me}", mine)
    except Exception as e:  # the store's host ended: so did the gang
        log.warning("reporting this rank's outcome of %s: %s", what, e)
    while len(said := verdicts(store, prefix, ranks) | {me: mine}) < len(ranks):
        if time.monotonic() > deadline:
            _stop(stuck_message(what, ranks, said, timeout_s))
        time.sleep(0.05)
    if error is not None:
        raise error
    return result
