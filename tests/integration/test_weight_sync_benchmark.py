"""CI smoke test of `benchmarks/weight_sync.py`: the collective rows on a small payload, and the
memory law it measures: a trainer rank's resident memory grows by at most two buckets during a
sync (VmHWM in the sender processes), far below its share of the model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MIB = 1 << 20


def test_a_streaming_rank_holds_at_most_two_buckets_beyond_its_training_state(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "weight_sync.py"),
        "--model-mib",
        "96",
        "--bucket-mib",
        "4",
    ]
    subprocess.run([*cmd, "--only", "collective", "--json", str(out)], check=True, timeout=600)
    (row,) = json.loads(out.read_text())
    share = row["model_bytes"] // 2  # what one of the 2 ranks sends, in bf16: 48 MiB
    assert row["bucket_bytes"] == 4 * MIB
    assert row["peak_extra_bytes_per_rank"] <= 2 * row["bucket_bytes"] + 2 * MIB < share / 2
    assert row["tracked_buffer_bytes_per_rank"] <= 2 * row["bucket_bytes"] + 64 * 1024
    assert row["gb_per_s"] > 0 and row["link_gb_per_s"] > 0
