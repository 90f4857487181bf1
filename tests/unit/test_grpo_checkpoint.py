"""Checkpoints on a real one-rank gloo group: round trip, atomic sealing, pruning, shape checks."""

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from grpo_rollout.testing import free_port
from grpo_trainer import checkpoint
from grpo_trainer.config import ConfigError, RankInfo

INFO = RankInfo(rank=0, local_rank=0, world_size=1, pod_index=0, ep_size=1)


@pytest.fixture(scope="module", autouse=True)
def gloo() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def save(root: Path, step: int, model, opt, keep_last: int = 3) -> Path:
    state = checkpoint.TrainState(step=step, version=step + 1, position=step * 8)
    return checkpoint.save(root, state, model, opt, INFO, keep_last=keep_last, spec={"x": 1})


def test_round_trip_restores_weights_optimizer_rng_and_counters(tmp_path: Path) -> None:
    model, opt = model_and_optimizer(0)
    torch.manual_seed(123)
    random.seed(7)
    path = save(tmp_path, 10, model, opt)
    expected_draw, expected_py = torch.rand(3), random.random()

    other, other_opt = model_and_optimizer(1)
    state = checkpoint.load(path, other, other_opt, INFO)
    assert state == checkpoint.TrainState(step=10, version=11, position=80)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True)
    )
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected_draw) and random.random() == expected_py
    meta = json.loads((path / "meta.json").read_text())
    assert meta["spec"] == {"x": 1} and meta["world_size"] == 1


def test_latest_ignores_unsealed_saves_and_prune_keeps_the_newest(tmp_path: Path) -> None:
    model, opt = model_and_optimizer(0)
    for step in (2, 4, 6):
        save(tmp_path, step, model, opt, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]
    (tmp_path / "step-00000008.tmp").mkdir()  # a crash mid-save
    (tmp_path / "step-00000009").mkdir()  # no meta.json: never sealed
    assert checkpoint.latest(tmp_path).name == "step-00000006"
    save(tmp_path, 10, model, opt, keep_last=2)
    assert not (tmp_path / "step-00000008.tmp").exists()
    assert checkpoint.latest(tmp_path).name == "step-00000010"


def test_latest_of_a_missing_root_is_none(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "nothing") is None


def test_a_different_gang_shape_is_a_config_error(tmp_path: Path) -> None:
    model, opt = model_and_optimizer(0)
    path = save(tmp_path, 2, model, opt)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "world_size": 4, "ep_size": 2}))
    with pytest.raises(ConfigError, match="saved by world size 4 / EP 2, this gang is 1 / EP 1"):
        checkpoint.load(path, model, opt, INFO)
