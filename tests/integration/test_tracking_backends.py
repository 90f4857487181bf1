"""Experiment tracking end to end: rank 0's ProgressReporter, opened on a contract whose spec names
a backend, logs the spec once and every report; each backend's own reader gets them back.

MLflow: a real `mlflow server` process (sqlite store in a temp folder, loopback port) read back
with MlflowClient. TensorBoard: the event files read back with tensorboard's EventAccumulator.
W&B: offline mode, its run file (LevelDB-log framed protobuf records) decoded with W&B's own
protobuf classes.
"""

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.report import EvalScore, StepReport
from grpo_trainer.progress import ProgressReporter

from tests.support.ports import free_port
from tests.support.progress import REPORT

SPEC = {
    "model": {"path": "/m"},
    "dataset": {"path": "/d.jsonl"},
    "reward": {"functions": [{"builtin": "math"}]},
}
BASELINE = EvalScore(step=0, reward=0.1, pass_at_k=0.5, k=4, prompts=8, seconds=1.0)


def reporter(tmp_path: Path, tracking: dict[str, Any], name: str = "tracked") -> ProgressReporter:
    job = GRPOJob.model_validate({"metadata": {"name": name}, "spec": {**SPEC, "tracking": tracking}})
    contract = render.contract(job, name=name, namespace="ns", local_ports=render.LocalPorts(1, (2,)))
    return ProgressReporter(contract, str(tmp_path / "progress.jsonl"), in_cluster=False)


def two_steps(r: ProgressReporter) -> None:
    """Step 3 carries the baseline evaluation (step 0), step 4 a kl metric; then the run closes."""
    r.report(REPORT.model_copy(update={"evals": [BASELINE]}))
    r.report(REPORT.model_copy(update={"step": 4, "reward_mean": 0.6, "metrics": {"kl": 0.02}, "evals": []}))
    r.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--backend-store-uri=sqlite:///{root}/mlflow.db",
        f"--default-artifact-root={root}/artifacts",
        "--workers=1",
    ]
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed below
    # its own process group: `mlflow server` runs uvicorn as a child, stopped with it below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240  # two busy cores: its first start migrates the sqlite schema
        while True:
            assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "mlflow server did not come up"
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


@pytest.mark.slow
def test_mlflow_run_holds_the_params_and_every_steps_metrics(tmp_path: Path, mlflow_server: str) -> None:
    from mlflow import MlflowClient

    r = reporter(tmp_path, {"backend": "mlflow", "uri": mlflow_server, "experiment": "grpo-tests"})
    two_steps(r)
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("grpo-tests")
    (run,) = client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'tracked'")
    assert run.info.status == "FINISHED"
    assert run.data.params["algorithm.learningRate"] == "1e-06"
    assert run.data.params["reward.functions"] == '[{"builtin": "math", "weight": 1.0}]'
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")}
    assert history == {3: 0.4, 4: 0.6}
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval_reward")} == {0: 0.1}
    assert [m.value for m in client.get_metric_history(run.info.run_id, "rollout_s")] == [0.1, 0.1]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "kl")] == [(4, 0.02)]


@pytest.mark.slow
def test_an_unreachable_tracking_server_costs_the_tracking_not_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    r = reporter(tmp_path, {"backend": "mlflow", "uri": f"http://127.0.0.1:{free_port()}"})
    assert r.tracker is None
    two_steps(r)
    assert len((tmp_path / "progress.jsonl").read_text().splitlines()) == 2


def test_tensorboard_event_files_hold_every_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = reporter(tmp_path, {"backend": "tensorboard", "uri": str(tmp_path / "tb")})
    two_steps(r)
    events = EventAccumulator(str(tmp_path / "tb" / "tracked" / "tracked"))  # <uri>/<experiment>/<job>
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["reward_mean"] == [(3, pytest.approx(0.4)), (4, pytest.approx(0.6))]
    assert scalars["eval_reward"] == [(0, pytest.approx(0.1))]
    assert scalars["eval_pass_at_k"] == [(0, pytest.approx(0.5))]
    assert scalars["ep_all_to_all_s"] == [(3, pytest.approx(0.05)), (4, pytest.approx(0.05))]
    params = events.Tensors("params/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| algorithm.learningRate | 1e-06 |" in params


def wandb_records(path: str) -> Iterator[Any]:
    """The protobuf Records of a W&B run file: a 7-byte file header, then LevelDB-log framing
    (32 KiB blocks; each chunk a 7-byte header of crc32, length, type 1 full / 2 first / 3 middle
    / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunks = Path(path).read_bytes(), 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def finished_wandb_records(wandb_dir: Path) -> list[Any]:
    """The records of the one offline run under `wandb_dir`, once they include its exit record:
    W&B's service process may still be writing the file when `finish()` has returned."""
    deadline = time.monotonic() + 60
    while True:
        (path,) = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
        records = list(wandb_records(path))
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


@pytest.mark.slow
def test_wandb_offline_run_file_holds_the_config_and_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    r = reporter(tmp_path, {"backend": "wandb", "experiment": "grpo-tests"})
    two_steps(r)
    records = finished_wandb_records(tmp_path)
    config: dict[str, object] = {}

    def flatten(key: str, value: object) -> None:  # W&B may write a section as one nested item
        if isinstance(value, dict):
            for k, v in value.items():
                flatten(f"{key}.{k}", v)
        else:
            config[key] = value

    for rec in records:  # the config of `init` travels in the run record or in config records
        for part in (rec.run.config, rec.config):
            for i in part.update:
                flatten(".".join(i.nested_key) or i.key, json.loads(i.value_json))
    assert config["algorithm.learningRate"] == "1e-06"
    history = [
        {".".join(i.nested_key) or i.key: i.value_json for i in rec.history.item}
        for rec in records
        if rec.HasField("history")
    ]
    assert [(h["_step"], h.get("reward_mean"), h.get("eval_reward")) for h in history] == [
        ("0", None, "0.1"),
        ("3", "0.4", None),
        ("4", "0.6", None),
    ]


def test_each_numeric_report_field_is_a_tracked_metric() -> None:
    from grpo_trainer import exporter

    logged = {**exporter.step_metrics(REPORT), **exporter.report_values(REPORT)}
    numeric = {
        f for f, v in REPORT.model_dump().items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    assert numeric <= set(logged) and set(REPORT.metrics) <= set(logged)
    assert StepReport.model_fields["rollout_s"].annotation is float


def test_every_backend_the_api_offers_has_a_tracker_and_each_secret_key_set() -> None:
    from grpo_operator.api.tracking import SECRET_KEYS, TrackingBackend
    from grpo_trainer.tracking import BACKENDS

    assert set(BACKENDS) == {b.value for b in TrackingBackend}
    assert set(SECRET_KEYS) < set(BACKENDS), "tensorboard alone reads no credentials"
