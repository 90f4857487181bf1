"""Trainer rank 0's Prometheus /metrics: reports handed to the ProgressReporter come out of a real
HTTP scrape of the exporter it started on the contract's metrics port, named and described by the
StepReport model (a new numeric field flows without an edit)."""

import urllib.error
import urllib.request
from pathlib import Path

import pytest
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.report import EvalScore, StepReport
from grpo_trainer import exporter
from grpo_trainer.progress import ProgressReporter
from prometheus_client.parser import text_string_to_metric_families

from tests.support.ports import free_port
from tests.support.progress import REPORT

SPEC = {
    "model": {"path": "/m"},
    "dataset": {"path": "/d.jsonl"},
    "reward": {"functions": [{"builtin": "math"}]},
}


def reporter(tmp_path: Path) -> ProgressReporter:
    job = GRPOJob.model_validate({"metadata": {"name": "j"}, "spec": SPEC})
    ports = render.LocalPorts(1, (2,), trainer_metrics_port=free_port())
    contract = render.contract(job, name="j", namespace="ns", local_ports=ports)
    return ProgressReporter(contract, str(tmp_path / "progress.jsonl"), in_cluster=False)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(exporter.PREFIX)
    }


def help_texts(port: int) -> dict[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {f.name: f.documentation for f in text_string_to_metric_families(text)}


@pytest.fixture
def running(tmp_path: Path):
    r = reporter(tmp_path)
    assert r.exporter is not None
    yield r
    r.close()


def test_a_reported_step_is_scraped_with_its_time_split_and_loss_metrics(running: ProgressReporter) -> None:
    port = running.exporter.port
    assert scrape(port) == {}, "nothing before the first step"
    running.report(REPORT.model_copy(update={"metrics": {**REPORT.metrics, "kl": 0.01, "clip_frac": 0.2}}))
    got = scrape(port)
    expected = {
        "grpo_trainer_step": 3,
        "grpo_trainer_reward_mean": 0.4,
        "grpo_trainer_tokens_per_second": 900.0,
        "grpo_trainer_rollout_seconds": 0.1,  # waiting for rollouts
        "grpo_trainer_train_seconds": 0.3,
        "grpo_trainer_ep_all_to_all_seconds": 0.05,
        "grpo_trainer_push_seconds": 0.1,  # the weight sync
        "grpo_trainer_step_seconds": 0.5,
        "grpo_trainer_rollout_wait_fraction": 0.2,  # the reporter's own window: 0.1 / 0.5
        "grpo_trainer_report_time_seconds": 1.7e9,
        "grpo_trainer_trained_samples": 48,
        "grpo_trainer_reward_timeouts_total": 2,  # the reporter's own sum over the attempt's steps
    }
    assert {name: got[(name, ())] for name in expected} == expected
    loss_side = {
        dict(labels)["name"]: v for (name, labels), v in got.items() if name == exporter.METRIC_FAMILY
    }
    assert loss_side == {**REPORT.metrics, "kl": 0.01, "clip_frac": 0.2}
    docs = help_texts(port)
    assert docs["grpo_trainer_rollout_seconds"] == StepReport.model_fields["rollout_s"].description


def test_missing_values_have_no_series_and_the_newest_report_wins(running: ProgressReporter) -> None:
    running.report(REPORT)
    running.report(
        REPORT.model_copy(update={"step": 4, "ep_all_to_all_s": None, "metrics": {"kl": float("nan")}})
    )
    got = scrape(running.exporter.port)
    assert got[("grpo_trainer_step", ())] == 4
    assert ("grpo_trainer_ep_all_to_all_seconds", ()) not in got, "no EP: no made-up zero"
    assert not [k for k in got if k[0] == exporter.METRIC_FAMILY], "a NaN is no value"


def test_the_newest_evaluation_stays_until_the_next_one(running: ProgressReporter) -> None:
    def score(step: int, reward: float) -> EvalScore:
        return EvalScore(step=step, reward=reward, pass_at_k=None, k=0, prompts=8, seconds=1.5)

    running.report(REPORT.model_copy(update={"evals": [score(0, 0.1), score(3, 0.3)]}))
    running.report(REPORT.model_copy(update={"step": 4, "evals": []}))  # no evaluation in this one
    got = scrape(running.exporter.port)
    assert got[("grpo_trainer_eval_reward", ())] == 0.3 and got[("grpo_trainer_eval_step", ())] == 3
    assert ("grpo_trainer_eval_pass_at_k", ()) not in got
    assert help_texts(running.exporter.port)["grpo_trainer_eval_reward"].startswith("Newest held-out")


def test_every_numeric_report_field_has_a_distinct_series_name() -> None:
    names = [exporter.series_name(f) for f in exporter.NUMERIC_FIELDS]
    names += [exporter.series_name(exporter.EVAL_PREFIX + f) for f in exporter.EVAL_FIELDS]
    assert len(set(names)) == len(names) and exporter.METRIC_FAMILY not in names
    assert "rollout_s" in exporter.NUMERIC_FIELDS and "ep_backend" not in exporter.NUMERIC_FIELDS


def test_closing_stops_the_server(tmp_path: Path) -> None:
    r = reporter(tmp_path)
    assert r.exporter is not None
    port = r.exporter.port
    r.close()
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_a_taken_port_costs_the_exporter_not_the_training(tmp_path: Path) -> None:
    first = reporter(tmp_path)
    assert first.exporter is not None
    job = GRPOJob.model_validate({"metadata": {"name": "j"}, "spec": SPEC})
    ports = render.LocalPorts(1, (2,), trainer_metrics_port=first.exporter.port)
    contract = render.contract(job, name="j", namespace="ns", local_ports=ports)
    second = ProgressReporter(contract, str(tmp_path / "other.jsonl"), in_cluster=False)
    assert second.exporter is None
    second.report(REPORT)  # the JSON line still flows
    second.close()
    first.close()
    assert len((tmp_path / "other.jsonl").read_text().splitlines()) == 1
