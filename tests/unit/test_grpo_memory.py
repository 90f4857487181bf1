"""The trainer's start-up memory check (`grpo_trainer.memory`): refuse on a GPU that cannot hold
the plan, with the numbers, before any weight is loaded; only log on CPU."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_trainer import memory
from grpo_trainer.config import ConfigError, RankInfo

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "model-configs"
H100 = 81559 * 2**20


def contract(tmp_path: Path, model: str):
    (tmp_path / "model").mkdir(exist_ok=True)
    shutil.copy(CONFIGS / f"{model}.config.json", tmp_path / "model" / "config.json")
    raw = yaml.safe_load((ROOT / "examples" / "p5-qwen3-30b-a3b.yaml").read_text())
    raw["spec"]["model"]["path"] = str(tmp_path / "model")
    ports = render.LocalPorts(trainer_master_port=29500, rollout_ports=(8000, 8001, 8002, 8003))
    return render.contract(GRPOJob.model_validate(raw), name="j", namespace="ns", local_ports=ports)


INFO = RankInfo(rank=0, local_rank=0, world_size=16, pod_index=0, ep_size=16)


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=H100))
    return torch.device("cuda", 0)


def test_a_job_that_cannot_fit_stops_with_the_numbers(tmp_path, h100, monkeypatch):
    monkeypatch.delenv(memory.ENV_MEMORY_PLAN, raising=False)
    with pytest.raises(ConfigError, match=r"trainer: [\d.]+ GiB per GPU, does NOT fit in 79.6 GiB"):
        memory.check(contract(tmp_path, "deepseek-v3"), INFO, h100)


def test_warn_mode_starts_anyway(tmp_path, h100, monkeypatch, caplog):
    monkeypatch.setenv(memory.ENV_MEMORY_PLAN, "warn")
    plan = memory.check(contract(tmp_path, "deepseek-v3"), INFO, h100)
    assert plan is not None and plan.fits is False and "starting anyway" in caplog.text


def test_cpu_only_logs_the_plan(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(memory.ENV_MEMORY_PLAN, raising=False)
    caplog.set_level("INFO")
    plan = memory.check(contract(tmp_path, "deepseek-v3"), INFO, torch.device("cpu"))
    assert plan is not None and plan.fits is None and "memory plan: trainer:" in caplog.text


def test_same_plan_as_the_cli(tmp_path, h100, monkeypatch):
    monkeypatch.delenv(memory.ENV_MEMORY_PLAN, raising=False)
    c = contract(tmp_path, "qwen3-30b-a3b")
    c.spec.trainer.sharding, c.spec.trainer.activation_checkpointing = "none", False
    with pytest.raises(ConfigError):  # replicated dense state and every layer's activations: too much
        memory.check(c, INFO, h100)
    from grpo_operator import memory_plan

    cfg = json.loads((tmp_path / "model" / "config.json").read_text())
    cli = memory_plan.plan_job(cfg, c.spec, trainer_gpu_bytes=H100, rollout_gpu_bytes=None)
    monkeypatch.setenv(memory.ENV_MEMORY_PLAN, "warn")
    assert memory.check(c, INFO, h100).total == cli.trainer.total


def test_no_config_no_check(tmp_path, h100, s3_server, caplog):
    c = contract(tmp_path, "qwen3-30b-a3b")
    c.spec.model.path = str(tmp_path / "nowhere")
    assert memory.check(c, INFO, h100) is None
    c.spec.model.path = f"{s3_server.make_bucket('memory-plan')}/absent"
    with s3_server.environ():
        assert memory.check(c, INFO, h100) is None
    assert "cannot read" in caplog.text


def test_an_s3_model_is_checked_from_its_config_json(tmp_path, h100, s3_server, monkeypatch):
    """s3:// models: the config.json is read through the storage layer before any shard is fetched."""
    monkeypatch.delenv(memory.ENV_MEMORY_PLAN, raising=False)
    bucket = s3_server.make_bucket("memory-plan")
    s3_server.fs().put(str(CONFIGS / "deepseek-v3.config.json"), f"{bucket[5:]}/deepseek/config.json")
    c = contract(tmp_path, "deepseek-v3")
    c.spec.model.path = f"{bucket}/deepseek"
    with s3_server.environ(), pytest.raises(ConfigError, match=r"does NOT fit in 79\.6 GiB"):
        memory.check(c, INFO, h100)
