"""Staging of bucketed weight versions, so the server swaps a version in only when all of it arrived.

The rollout server feeds every POST /weights bucket to `WeightStager.add`; when it returns the
complete list of buckets, the server hands them to the engine in one call. Pure bookkeeping, no I/O,
so the version rules below are unit-tested directly:
- a bucket of the live version is a harmless re-send (the reply says which version is live);
- a bucket older than the live or the staged version is a conflict (a confused or stale trainer);
- a bucket of a newer version than the staged one discards the unfinished older version.
"""

from dataclasses import dataclass, field

from grpo_rollout.protocol import WeightBucket


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
