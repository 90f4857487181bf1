"""`benchmarks/trainer_memory.py --quick` runs the trainer's step at world 1 and 2 and writes the
promised rows (the numbers themselves are in benchmarks/RESULTS.md; nothing here is timed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"world", "ep", "sharding", "peak_rss_mib_per_rank", "planned_mib_per_rank", "model_mib"}


@pytest.mark.slow
def test_quick_memory_benchmark_writes_measured_and_planned_rows(tmp_path: Path) -> None:
    out = tmp_path / "mem.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/trainer_memory.py"), "--quick", "--json", str(out)],
        check=True, cwd=ROOT, timeout=600, capture_output=True,
    )  # fmt: skip
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["world"], r["ep"], r["sharding"]) for r in rows] == [(1, 1, "full"), (2, 2, "full")]
    for row in rows:
        assert row.keys() >= FIELDS
        assert row["peak_rss_mib_per_rank"] > row["base_rss_mib"] > 0
        assert row["planned_mib_per_rank"] > row["base_rss_mib"]
        assert all(p > 0 for p in row["peaks_mib"]) and len(row["peaks_mib"]) == row["world"]
    assert set(report["checks"]) == {"world4_full_at_most_half_of_world1", "within_30pct_of_plan"}
