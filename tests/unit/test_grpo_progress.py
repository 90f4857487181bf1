"""Rank 0's progress lines: one JSON object per step, readable by the local runtime."""

import json
from pathlib import Path

import pytest
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_operator.local.progress import ProgressLog
from grpo_trainer.config import ENV_PROGRESS_FILE
from grpo_trainer.progress import ProgressReporter

RECORD = {"step": 3, "reward_mean": 0.4, "tokens_per_s": 900.0, "samples_per_s": 120.0, "samples": 64,
          "staleness": 1, "weight_version": 3, "position": 24, "time": 1.7e9}  # fmt: skip


def contract():
    spec = {
        "model": {"path": "/m"},
        "dataset": {"path": "/d.jsonl"},
        "reward": {"functions": [{"builtin": "math"}]},
    }
    job = GRPOJob.model_validate(
        {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "j"}, "spec": spec}
    )
    return render.contract(job, name="j", namespace="ns", local_ports=render.LocalPorts(1, (2,)))


def test_records_append_to_the_progress_file_and_the_runtime_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv(ENV_PROGRESS_FILE, str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    reporter = ProgressReporter.from_env(contract(), ENV_PROGRESS_FILE)
    reporter.report(RECORD)
    reporter.report({**RECORD, "step": 4, "reward_mean": 0.5}, checkpoint=("/ckpt/step-00000004", 4))
    reporter.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3, 4]
    log = ProgressLog(path)
    records = log.poll()
    assert [(r.step, r.reward, r.weight_version, r.staleness, r.samples) for r in records] == [
        (3, 0.4, 3, 1.0, 64),
        (4, 0.5, 3, 1.0, 64),
    ]
    assert records[0].tokens_per_s == 900.0 and records[0].samples_per_s == 120.0


def test_without_a_progress_file_lines_go_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    reporter = ProgressReporter(contract(), None, in_cluster=False)
    reporter.report(RECORD)
    reporter.close()
    assert json.loads(capsys.readouterr().out) == RECORD


def test_a_cluster_without_credentials_never_stops_the_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # in_cluster config cannot load
    reporter = ProgressReporter(contract(), str(tmp_path / "p.jsonl"), in_cluster=True)
    reporter.report(RECORD)
    reporter.close()
    assert json.loads((tmp_path / "p.jsonl").read_text()) == RECORD
