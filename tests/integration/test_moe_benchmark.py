"""`benchmarks/ep_layer.py --quick` runs both layers at EP 1 and 2 and writes the promised JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {
    "regime",
    "ep",
    "tokens",
    "ours_tokens_per_s",
    "deepspeed_tokens_per_s",
    "ratio",
    "roofline_tokens_per_s",
    "ours_bytes_sent_per_rank_per_s",
}


@pytest.mark.slow
def test_quick_benchmark_writes_rows_for_every_regime_and_ep(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/grpo-operator/torch_extensions"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/ep_layer.py"), "--quick", "--json", str(out)],
        env=env, cwd=ROOT, timeout=600, capture_output=True, text=True,
    )  # fmt: skip
    # failed once in a full suite (2026-12-07) and not in 3 runs alone: a failure must say why
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["regime"], r["ep"]) for r in rows} == {
        (g, e) for g in ("coarse", "fine", "skewed") for e in (1, 2)
    }
    for row in rows:
        assert row.keys() >= FIELDS
        assert row["ours_tokens_per_s"] > 0 and row["deepspeed_tokens_per_s"] > 0
        assert row["ours_experts_only_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["ours_tokens_per_s"] / row["deepspeed_tokens_per_s"])
        assert (row["ours_bytes_sent_per_rank_per_s"] > 0) == (row["ep"] > 1)
    assert result["machine"] and result["date"]
