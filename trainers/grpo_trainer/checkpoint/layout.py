"""Where saves live and which one to resume: names, the completion marker, pure choices.

Layout under the contract's checkpointDir (`<checkpoint.path>/<namespace>/<name>-<uid>`):

    step-00000010/rank-00000.distcp   rank 0's tensors (raw bytes)     every rank writes its own,
    step-00000010/rank-00000.json     their keys, chunks and CRC-32s   in parallel, no rank-0 mkdir
    step-00000010/meta.json           the marker, written last by rank 0 once every rank's files
                                      are durable: TrainState, gang shape, sha256 of each rank file
    export/step-00000020/             Hugging Face exports (checkpoint.exportEverySteps)
    final/                            the trained policy, Hugging Face format (end of training)

A save without its marker is incomplete (a crash or SIGKILL mid-save) and never resumed.
"""

import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

STEP_DIR = re.compile(r"^step-(\d{8})$")
MARKER = "meta.json"
MARKER_FORMAT = "grpo-checkpoint/1"
EXPORT_DIR, FINAL_DIR = "export", "final"


@dataclass
class TrainState:
    """The loop's counters: everything besides tensors that a resumed run must continue from."""

    step: int = 0  # optimizer steps completed
    version: int = 0  # weight version of the current policy (rollout servers run <= this)
    position: int = 0  # global dataset position of the first prompt not trained on yet


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    m = STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m[1]) if m else None


def marker(
    state: TrainState, *, world_size: int, ep_size: int, ranks: dict[int, str], spec: dict[str, Any]
) -> bytes:
    """The marker's bytes: `ranks` maps each rank to the sha256 of its metadata file."""
    doc = {
        "format": MARKER_FORMAT,
        "state": asdict(state),
        "world_size": world_size,
        "ep_size": ep_size,
        "ranks": {str(r): d for r, d in sorted(ranks.items())},
        "saved_at": time.time(),
        "spec": spec,
    }
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def parse_marker(body: bytes) -> tuple[TrainState, dict[int, str]]:
    """(TrainState, rank → metadata sha256); ValueError when it is not a complete marker."""
    doc = json.loads(body)
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
        raise ValueError(f"not a {MARKER_FORMAT} marker")
    ranks = {int(r): str(d) for r, d in doc["ranks"].items()}
    if sorted(ranks) != list(range(int(doc["world_size"]))):
        raise ValueError(f"marker lists ranks {sorted(ranks)} for world size {doc['world_size']}")
    s = doc["state"]
    return TrainState(step=int(s["step"]), version=int(s["version"]), position=int(s["position"])), ranks


def newest_first(complete: list[int]) -> list[int]:
    """Resume candidates: complete saves, newest first (the next one is the fallback)."""
    return sorted(set(complete), reverse=True)


def to_prune(
    complete: list[int], incomplete: list[int], *, current: int, keep_last: int
) -> tuple[list[int], list[int]]:
    """(complete saves to delete, incomplete saves to delete) once `current` is sealed.

    Keeps the newest `keep_last` complete saves; incomplete ones older than `current` are leftovers
    of a crash (this gang has at most one save in flight: the one just sealed)."""
    kept = newest_first([*complete, current])[:keep_last]
    old = sorted(s for s in set(complete) if s not in kept)
    stale = sorted(s for s in set(incomplete) if s < current)
    return old, stale
