"""`grpo-operator validate` and the trainer's start-up check give every example the same memory verdict.

Issue 20 item 9: validate called the p5en example valid while its trainer refused it at start
(369.9 GiB per GPU against 140.4). Both now call `memory_plan.plan_job` and `RolePlan.refusal`; here
each GRPOJob under examples/ goes through both: validate with the model's config.json, and the
trainer's `memory.check` on the contract the operator renders for it, on its instance type's GPU.
"""

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from grpo_operator import instance_types, render, validation
from grpo_operator.api.job import GRPOJob
from grpo_trainer import memory
from grpo_trainer.config import ConfigError, RankInfo
from grpo_trainer.tiny_model import TinyConfig, build_model, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "model-configs"
TABLE = instance_types.load()
JOBS = [
    (path, doc)
    for path in sorted((ROOT / "examples").rglob("*.yaml"))
    for doc in yaml.safe_load_all(path.read_text())
    if isinstance(doc, dict) and doc.get("kind") == "GRPOJob"
]


def model_config(doc: dict[str, Any], tmp_path: Path) -> Path:
    """The config.json of the model an example names: Qwen3-30B-A3B's, or the tiny demo model's."""
    if "qwen3-30b-a3b" in doc["spec"]["model"]["path"].lower():
        return CONFIGS / "qwen3-30b-a3b.config.json"
    out = tmp_path / "tiny.config.json"
    out.write_text(json.dumps(build_model(TinyConfig(), build_tokenizer()).config.to_dict()))
    return out


def offline(doc: dict[str, Any], config: Path, tmp_path: Path) -> list[str]:
    """validate's memory errors for the job (anything else wrong with an example fails the test)."""
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    problems = validation.validate_file(manifest, warnings=[], model_config=config)
    assert [p for p in problems if p.path != "spec.trainer"] == []
    return [p.message for p in problems]


def at_start(doc: dict[str, Any], config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The trainer's start-up refusal for the job, on its instance type's GPU (the CPU without one)."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(config, model / "config.json")
    raw = copy.deepcopy(doc)
    raw["spec"]["model"]["path"] = str(model)
    job = GRPOJob.model_validate(raw)
    contract = render.contract(job, name=raw["metadata"]["name"], namespace="ns")
    itype = job.spec.trainer.instance_type
    gpu = TABLE.get(itype).gpu_memory_bytes if itype else None
    device = torch.device("cpu")
    if gpu is not None:  # no GPU here: the device reports the instance type's memory, as nvidia-smi does
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=gpu))
        device = torch.device("cuda", 0)
    info = RankInfo(rank=0, local_rank=0, world_size=1, pod_index=0, ep_size=1)
    try:
        memory.check(contract, info, device)
    except ConfigError as e:
        return [str(e)]
    return []


@pytest.mark.parametrize(("path", "doc"), JOBS, ids=[f"{p.name}:{d['metadata']['name']}" for p, d in JOBS])
def test_validate_and_the_start_up_check_agree_on_every_example(path, doc, tmp_path, monkeypatch):
    monkeypatch.delenv(memory.ENV_MEMORY_PLAN, raising=False)
    config = model_config(doc, tmp_path)
    verdict = offline(doc, config, tmp_path)
    assert verdict == at_start(doc, config, tmp_path, monkeypatch)
    assert verdict == [], f"{path}: an example must fit (or say why it cannot): {verdict}"


def test_a_trainer_that_cannot_fit_is_refused_by_both_with_the_same_numbers(tmp_path, monkeypatch):
    """The p5en example as it was (ZeRO-1, no activation checkpointing): 369.9 GiB against 140.4."""
    monkeypatch.delenv(memory.ENV_MEMORY_PLAN, raising=False)
    path = ROOT / "examples" / "p5en-qwen3-30b-a3b.yaml"
    doc = next(d for p, d in JOBS if p == path)
    doc = copy.deepcopy(doc)
    doc["spec"]["trainer"]["sharding"] = "optimizer"
    config = model_config(doc, tmp_path)
    verdict = offline(doc, config, tmp_path)
    assert verdict == at_start(doc, config, tmp_path, monkeypatch)
    assert len(verdict) == 1 and "369.9 GiB per GPU, does NOT fit in 140.4 GiB" in verdict[0]


def test_validate_says_when_it_cannot_check_memory(capsys):
    """A pvc:// or s3:// model: valid for the API server, with a warning that the plan did not run."""
    from grpo_operator.cli import main

    path = ROOT / "examples" / "p5en-qwen3-30b-a3b.yaml"
    assert main(["validate", str(path)]) == 0
    assert "warning: spec.model.path: no memory plan" in capsys.readouterr().err
    assert main(["validate", str(path), "--model-config", str(CONFIGS / "qwen3-30b-a3b.config.json")]) == 0
    assert "warning" not in capsys.readouterr().err
