"""The trainer's first check (`grpo_trainer.inputs`): model folders and the checkpoint folder judged
before any GPU work, failing with the field first and a reason the job's status carries."""

from pathlib import Path

import pytest
import yaml
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.status import TRAINER_STATED, Reason
from grpo_trainer.config import ConfigError, RankInfo
from grpo_trainer.inputs import check_inputs

ROOT = Path(__file__).resolve().parents[2]
MAIN = RankInfo(rank=0, local_rank=0, world_size=2, pod_index=0, ep_size=2)


def contract(tmp_path: Path, **model: str):
    raw = yaml.safe_load((ROOT / "examples" / "tiny-local.yaml").read_text())
    raw["spec"]["model"] = {"path": str(tmp_path / "model"), **model}
    raw["spec"]["checkpoint"]["path"] = str(tmp_path / "ckpt")
    ports = render.LocalPorts(trainer_master_port=29500, rollout_ports=(8000,))
    return render.contract(GRPOJob.model_validate(raw), name="j", namespace="ns", local_ports=ports)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(b"\0")
    return tmp_path / "model"


def stated(tmp_path: Path, reason: Reason, start: str, **model: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_inputs(contract(tmp_path, **model), MAIN)
    assert e.value.reason == reason and reason in TRAINER_STATED
    assert e.value.stated().startswith(f"{reason}: {start}"), e.value.stated()


def test_good_inputs_pass_and_the_write_probe_leaves_an_empty_job_folder(tmp_path: Path, model: Path) -> None:
    job = contract(tmp_path)
    check_inputs(job, MAIN)
    assert list(Path(job.checkpoint_dir).iterdir()) == []


def test_a_missing_model_names_spec_model_path(tmp_path: Path) -> None:
    stated(tmp_path, Reason.PATH_NOT_FOUND, f"spec.model.path {tmp_path / 'model'}: does not exist")


def test_a_reference_model_that_is_a_file_names_its_field(tmp_path: Path, model: Path) -> None:
    ref = str(model / "config.json")
    stated(tmp_path, Reason.PATH_WRONG_KIND, f"spec.model.referencePath {ref}: is a file", referencePath=ref)


def test_a_checkpoint_path_that_is_a_file_fails_before_the_first_save(tmp_path: Path, model: Path) -> None:
    (tmp_path / "ckpt").write_text("not a folder")
    stated(tmp_path, Reason.PATH_WRONG_KIND, "spec.checkpoint.path ")
