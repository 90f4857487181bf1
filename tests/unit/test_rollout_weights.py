"""Version rules of bucketed weight staging (grpo_rollout.weights.WeightStager)."""

import pytest
from grpo_rollout.weights import BadBucket, WeightConflict, WeightStager
from grpo_wire.protocol import WeightBucket


def bucket(version: int, index: int, count: int) -> WeightBucket:
    return WeightBucket(version=version, index=index, count=count)


def test_version_completes_only_with_its_last_bucket_in_order():
    s = WeightStager()
    assert s.add(bucket(1, 2, 3), b"c") is None
    assert s.add(bucket(1, 0, 3), b"a") is None
    assert s.add(bucket(1, 0, 3), b"a") is None  # a re-send does not count twice
    assert s.add(bucket(1, 1, 3), b"b") == [b"a", b"b", b"c"]
    s.applied(1)
    assert (s.live_version, s.staged_version, s.buckets) == (1, None, {})


def test_resend_of_live_version_is_harmless_and_older_versions_conflict():
    s = WeightStager(live_version=4)
    assert s.add(bucket(4, 0, 1), b"x") is None
    with pytest.raises(WeightConflict, match="older than the live version 4"):
        s.add(bucket(3, 0, 1), b"x")


def test_newer_version_discards_an_unfinished_older_one():
    s = WeightStager()
    s.add(bucket(1, 0, 2), b"old")
    assert s.add(bucket(2, 0, 2), b"new0") is None
    assert s.add(bucket(2, 1, 2), b"new1") == [b"new0", b"new1"]
    with pytest.raises(WeightConflict, match="being staged"):
        s.add(bucket(1, 1, 2), b"late")


def test_inconsistent_bucket_count_is_rejected():
    s = WeightStager()
    s.add(bucket(1, 0, 2), b"a")
    with pytest.raises(BadBucket, match="3 buckets here, 2 before"):
        s.add(bucket(1, 1, 3), b"b")
