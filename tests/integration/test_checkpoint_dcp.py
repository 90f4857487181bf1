"""DCP checkpoints over real gloo ranks: every rank writes its shards, saves reshard on load.

One spawn per gang shape, all on the tiny MoE model (4 experts) with AdamW under ZeRO-1:
- world 2 / EP 2 saves (async, sealed by the marker); a world 1 / EP 1 gang and a world 2 / EP 1
  gang load it and hold exactly the same weights and AdamW moments, key for key, in the global
  key space (which is what every shape agrees on);
- the reverse: world 1 / EP 1 saves, world 2 / EP 2 loads;
- each rank's data file holds only what that rank wrote (replicated tensors once, not per rank);
- a flipped byte in a data file is refused by its CRC-32 (no silent garbage).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import start_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.rollout import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _gang(rank: int, world: int, ep: int, port: int, model_dir: str, sharding: str = "optimizer"):
    from grpo_trainer.config import RankInfo
    from grpo_trainer.optim import GangAdamW
    from grpo_trainer.parallel import load_policy, make_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    info = RankInfo(rank=rank, local_rank=rank, world_size=world, pod_index=0, ep_size=ep)
    groups = make_groups(info)
    model = load_policy(model_dir, groups, "gloo", torch.device("cpu"), sharding=sharding)
    opt = GangAdamW(model, groups, lr=1e-2, sharding=sharding)
    return info, groups, model, opt


def _global_view(model, opt, info) -> dict[str, torch.Tensor]:
    """Every weight and AdamW tensor this rank holds, under its global key (cloned; FSDP2
    DTensors gathered whole, a collective in the same key order on every rank)."""
    from grpo_trainer import checkpoint
    from torch.distributed.tensor import DTensor

    entries = {**checkpoint.model_entries(model), **checkpoint.optimizer_entries(model, opt)}
    return {
        k: (e.tensor.full_tensor() if isinstance(e.tensor, DTensor) else e.tensor).detach().clone()
        for k, e in entries.items()
    }


def _worker(
    rank: int, world: int, ep: int, port: int, model_dir: str, mode: str, uri: str, out: str, sharding: str
) -> None:
    from grpo_trainer import checkpoint
    from torch.distributed.tensor import DTensor, distribute_tensor

    info, _groups, model, opt = _gang(rank, world, ep, port, model_dir, sharding)
    if mode == "save":
        torch.manual_seed(1)  # same "gradient" everywhere: replicas stay identical, as after a sync
        for _ in range(2):
            for p in model.parameters():
                g = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
            opt.step()
        group = dist.new_group(backend="gloo")
        saver = checkpoint.Saver(str(Path(uri).parent), info, group, keep_last=2, spec={})
        t0 = time.monotonic()
        saver.save(
            checkpoint.TrainState(step=2, version=2, position=8), checkpoint.gang_state(model, opt, info)
        )
        staged = time.monotonic() - t0
        saver.close()
        result = {"staged_s": staged, "sealed_s": time.monotonic() - t0}
    else:
        t0 = time.monotonic()
        try:
            state = checkpoint.load_save(uri, model, opt, info)
        except Exception as e:  # reported to the test, which expects it for damaged saves
            result = {"error": f"{type(e).__name__}: {e}"}
        else:
            result = {"step": state.step, "position": state.position, "load_s": time.monotonic() - t0}
    view = _global_view(model, opt, info)
    torch.save(view, f"{out}/{mode}-w{world}-r{rank}.pt")
    Path(f"{out}/{mode}-w{world}-r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_gang(
    world: int, ep: int, model_dir: Path, mode: str, uri: str, out: Path, sharding: str = "optimizer"
) -> list[dict]:
    from tests.support.ports import free_port

    args = (world, ep, free_port(), str(model_dir), mode, uri, str(out), sharding)
    start_ranks(_worker, args, world)
    return [json.loads((out / f"{mode}-w{world}-r{r}.json").read_text()) for r in range(world)]


def union(out: Path, mode: str, world: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in range(world):
        merged.update(torch.load(out / f"{mode}-w{world}-r{r}.pt", weights_only=True))
    return merged


def assert_same(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    weights = {k for k in saved if not k.startswith("optim.")}
    assert weights == {k for k in loaded if not k.startswith("optim.")}
    assert {k for k in saved if k.endswith(".exp_avg")} == {k for k in loaded if k.endswith(".exp_avg")}
    for k, v in loaded.items():
        assert torch.equal(v, saved[k]), k


@pytest.mark.parametrize("ep", [2, 1])
def test_fsdp2_full_save_loads_unsharded_and_back(tiny: Path, tmp_path: Path, ep: int) -> None:
    """trainer.sharding full (dense DTensors, each rank writes its row chunks; at EP 1 the experts
    too are FSDP2-split, each rank writing the whole experts it stores) saves and loads in the same
    global key space as the other modes: world 2 full -> world 1, and back."""
    out = tmp_path / "out"
    out.mkdir()
    save_dir = tmp_path / "ckpt" / "step-00000002"
    run_gang(2, ep, tiny, "save", str(save_dir), out, sharding="full")
    saved = union(out, "save", 2)
    assert any(".experts.gate_up_proj.3" in k for k in saved)  # per-expert keys kept
    assert any(".experts.down_proj.3.exp_avg" in k for k in saved)
    run_gang(1, 1, tiny, "load", str(save_dir), out)
    assert_same(saved, union(out, "load", 1))
    back = tmp_path / "ckpt1" / "step-00000002"
    run_gang(1, 1, tiny, "save", str(back), out)
    run_gang(2, ep, tiny, "load", str(back), out, sharding="full")
    assert_same(union(out, "save", 1), union(out, "load", 2))


def test_ep2_save_loads_at_ep1_and_world2_ep1_then_back(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    save_dir = tmp_path / "ckpt" / "step-00000002"
    timing = run_gang(2, 2, tiny, "save", str(save_dir), out)
    saved = union(out, "save", 2)
    assert any(".experts.gate_up_proj.3" in k for k in saved)  # per-expert keys
    assert sorted(p.name for p in save_dir.iterdir()) == [
        "meta.json", "rank-00000.distcp", "rank-00000.json", "rank-00001.distcp", "rank-00001.json"
    ]  # fmt: skip
    # replicated tensors are written once: the two data files together are about one model + AdamW
    held = sum(v.numel() * v.element_size() for v in saved.values())
    written = sum((save_dir / f"rank-0000{r}.distcp").stat().st_size for r in (0, 1))
    assert written < 1.05 * held
    for shape in ((1, 1), (2, 1)):
        loads = run_gang(*shape, tiny, "load", str(save_dir), out)
        assert all(r["step"] == 2 and r["position"] == 8 for r in loads)
        assert_same(saved, union(out, "load", shape[0]))
    print(f"\nEP2 save: staged {timing[0]['staged_s']:.3f}s, sealed {timing[0]['sealed_s']:.3f}s; "
          f"EP1 load {loads[0]['load_s']:.3f}s", file=sys.stderr)  # fmt: skip

    back = tmp_path / "ckpt1" / "step-00000002"
    run_gang(1, 1, tiny, "save", str(back), out)
    run_gang(2, 2, tiny, "load", str(back), out)
    assert_same(union(out, "save", 1), union(out, "load", 2))


def test_flipped_byte_fails_the_crc(tiny: Path, tmp_path: Path) -> None:
    from grpo_trainer.checkpoint.dcp_io import CorruptCheckpoint

    out = tmp_path / "out"
    out.mkdir()
    save_dir = tmp_path / "ckpt" / "step-00000002"
    run_gang(1, 1, tiny, "save", str(save_dir), out)
    data = save_dir / "rank-00000.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    [result] = run_gang(1, 1, tiny, "load", str(save_dir), out)
    assert result["error"].startswith(CorruptCheckpoint.__name__) and "checksum mismatch" in result["error"]
