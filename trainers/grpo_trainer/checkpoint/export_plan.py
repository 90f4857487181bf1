"""Who writes which tensor of a Hugging Face export, into which file: pure choices, same on every rank.

Used by `grpo_trainer.checkpoint.export`. The export is cut into units: one routed expert of one
fused expert parameter (written by a rank that stores that expert, no communication), or one
dense state-dict entry (replicated: written by any rank; FSDP2-sharded: gathered to the rank
that writes it, every rank taking part). A unit yields one or more checkpoint tensors (a fused
`gate_up_proj` expert gives its `gate_proj` and `up_proj`). Writers are chosen greedily, in the
units' order, as the least-loaded rank among those that can write the unit, so the bytes spread
over the ranks; each rank's units then fill files of at most `max_shard_bytes` (a unit larger
than that gets a file of its own), numbered rank by rank: `model-00001-of-0000N.safetensors`.
Every rank computes the same plan from the same inputs, so no plan is sent.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

WEIGHTS = "model-{index:05d}-of-{total:05d}.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Unit:
    """One piece of the export that a single rank writes."""

    source: str  # the in-memory state-dict key
    expert: int | None  # the global expert id within a fused expert parameter, else None
    outputs: tuple[tuple[str, tuple[int, ...]], ...]  # (checkpoint name, shape) it yields
    holders: tuple[int, ...]  # ranks that hold it whole; () means gathered from every rank

    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.outputs)


@dataclass(frozen=True)
class File:
    name: str
    writer: int
    units: tuple[Unit, ...]


@dataclass(frozen=True)
class Plan:
    files: tuple[File, ...]
    writer: dict[Unit, int]

    def weight_map(self) -> dict[str, str]:
        """Checkpoint name -> file, as `model.safetensors.index.json` records it."""
        return {name: f.name for f in self.files for u in f.units for name, _ in u.outputs}

    def of(self, rank: int) -> list[File]:
        return [f for f in self.files if f.writer == rank]


def plan(units: Sequence[Unit], world: int, itemsize: int, max_shard_bytes: int) -> Plan:
    """Writers and files for `units` (in this order) over `world` ranks."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    names = [n for u in units for n, _ in u.outputs]
    if len(set(names)) != len(names):
        raise ValueError(
            f"the export names a tensor twice: {sorted({n for n in names if names.count(n) > 1})[:3]}"
        )
    load = [0] * world
    writer: dict[Unit, int] = {}
    for u in units:
        candidates = u.holders or tuple(range(world))
        if not candidates or not all(0 <= r < world for r in candidates):
            raise ValueError(f"{u.source} (expert {u.expert}): no rank of {world} holds it ({u.holders})")
        rank = min(candidates, key=lambda r: (load[r], r))
        writer[u] = rank
        load[rank] += u.numel() * itemsize
    groups: list[tuple[int, list[Unit]]] = []
    for rank in range(world):
        size = 0
        for u in (u for u in units if writer[u] == rank):
            nbytes = u.numel() * itemsize
            if not groups or groups[-1][0] != rank or (size and size + nbytes > max_shard_bytes):
                groups.append((rank, []))
                size = 0
            groups[-1][1].append(u)
            size += nbytes
    total = len(groups)
    files = tuple(
        File(WEIGHTS.format(index=i + 1, total=total), rank, tuple(us)) for i, (rank, us) in enumerate(groups)
    )
    return Plan(files, writer)
