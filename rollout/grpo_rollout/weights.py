"""Staging of bucketed weight versions, so the server swaps a version in only when all of it arrived.

The rollout server feeds every POST /weights bucket to `WeightStager.add`; when it returns the
complete list of buckets, the server hands them to the engine in one call. Pure bookkeeping, no I/O,
so the version rules below are unit-tested directly:
- a bucket of the live version is a harmless re-send (the reply says which version is live);
- a bucket older than the live or the staged version is a conflict (a confused or stale trainer);
- a bucket of a newer version than the staged one discards the unfinished older version.
`Coverage` does the same for a streamed version (the collective transport): it goes live only
when every element of every announced tensor arrived.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from grpo_wire.protocol import WeightBucket


class WeightConflict(Exception):
    """The bucket cannot belong to any version this server could still apply (HTTP 409)."""


class BadBucket(Exception):
    """The bucket contradicts the buckets already staged for its version (HTTP 422)."""


@dataclass
class WeightStager:
    live_version: int = 0
    staged_version: int | None = None
    staged_count: int = 0
    buckets: dict[int, bytes] = field(default_factory=dict)

    def add(self, meta: WeightBucket, data: bytes) -> list[bytes] | None:
        """Stage one bucket; return all buckets of its version, in order, once the last one is in."""
        if meta.version == self.live_version:
            return None  # re-send of the live version
        if meta.version < self.live_version:
            raise WeightConflict(
                f"weight version {meta.version} is older than the live version {self.live_version}"
            )
        if self.staged_version is not None and meta.version < self.staged_version:
            raise WeightConflict(
                f"weight version {meta.version} is older than version {self.staged_version} being staged"
            )
        if meta.version != self.staged_version:
            self.discard()
            self.staged_version, self.staged_count = meta.version, meta.count
        if meta.count != self.staged_count:
            raise BadBucket(f"version {meta.version}: {meta.count} buckets here, {self.staged_count} before")
        self.buckets[meta.index] = data
        if len(self.buckets) < self.staged_count:
            return None
        return [self.buckets[i] for i in range(self.staged_count)]

    def applied(self, version: int) -> None:
        self.live_version = version
        self.discard()

    def discard(self) -> None:
        self.staged_version, self.staged_count, self.buckets = None, 0, {}


class Coverage:
    """Which elements of a streamed version arrived: the version may go live only when, for every
    announced tensor, the pieces cover each element this member holds exactly once (`held`: element
    ranges per tensor, sorted and disjoint; default the whole tensor). A piece outside what the member
    holds is refused: the trainer sent what this member does not keep."""

    def __init__(
        self, shapes: Mapping[str, Sequence[int]], held: Mapping[str, list[tuple[int, int]]] | None = None
    ) -> None:
        self.numel = {name: math.prod(shape) for name, shape in shapes.items()}
        self.held = {name: (held or {}).get(name, [(0, n)]) for name, n in self.numel.items()}
        self.ranges: dict[str, list[tuple[int, int]]] = {name: [] for name in shapes}

    def add(self, name: str, start: int, count: int) -> None:
        if name not in self.ranges:
            raise BadBucket(f"piece of {name!r}, which the update did not announce")
        if start < 0 or count < 0 or start + count > self.numel[name]:
            raise BadBucket(f"piece [{start}, {start + count}) of {name!r} outside its {self.numel[name]}")
        if not any(lo <= start and start + count <= hi for lo, hi in self.held[name]):
            raise BadBucket(f"piece [{start}, {start + count}) of {name!r} is not in what this member holds")
        self.ranges[name].append((start, start + count))

    def missing(self) -> list[str]:
        """Tensors not covered exactly (a gap or an overlap), by name."""
        bad = []
        for name, ranges in self.ranges.items():
            want = [(lo, hi) for lo, hi in self.held[name] if hi > lo]
            got = sorted((lo, hi) for lo, hi in ranges if hi > lo)
            merged: list[tuple[int, int]] = []
            for lo, hi in got:
                if merged and merged[-1][1] == lo:
                    merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
            total = sum(hi - lo for lo, hi in want)
            if merged != want or sum(hi - lo for lo, hi in got) != total:
                bad.append(name)
        return bad
