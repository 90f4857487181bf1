"""`trainer.optimizerOffload: cpu` on real gloo ranks: DeepSpeed's CPU Adam takes torch AdamW's steps.

Each gang loads the tiny MoE twice with the trainer's loader, builds `GangAdamW` once with torch
AdamW and once with offload (`grpo_trainer.offload.CPUOffloadAdamW`, DeepSpeed's JIT-built
`cpu_adam` op), and runs three real steps on both: forward on this rank's tokens, backward,
gradient sync, optimizer step. Sharding full at world 2 / EP 1 (dense and expert FSDP2 shards:
DTensor state) and optimizer at world 2 / EP 2 (ZeRO-1 with the offloading optimizer inside).
The gathered weights agree within float tolerance, and the offloaded state is host tensors.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.support.ranks import start_ranks

pytestmark = pytest.mark.slow
STEPS = 3
# The two Adams round differently (about 1e-7 per step) and Adam's normalisation lets later steps
# amplify that in proportion to lr: at 1e-3 three steps stay within 2e-5 (moving weights by ~3e-3)
LR = 1e-3


def _steps(model, opt, groups, rank: int) -> None:
    from grpo_trainer.parallel import sync_gradients

    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        ids = torch.randint(3, 90, (2, 7), generator=gen)
        opt.zero_grad()
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        sync_gradients(model, groups)
        opt.step()


def worker(rank: int, world: int, ep: int, sharding: str, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from grpo_trainer import moe
    from grpo_trainer.config import RankInfo
    from grpo_trainer.optim import GangAdamW
    from grpo_trainer.parallel import load_policy, make_groups
    from torch.distributed.tensor import DTensor

    groups = make_groups(RankInfo(rank=rank, local_rank=rank, world_size=world, pod_index=0, ep_size=ep))
    cpu = torch.device("cpu")
    states, report = {}, {}
    for offload in ("none", "cpu"):
        model = load_policy(model_dir, groups, "gloo", cpu, sharding=sharding)
        opt = GangAdamW(model, groups, lr=LR, sharding=sharding, offload=offload)
        _steps(model, opt, groups, rank)
        states[offload] = moe.full_state_dict(model)
        if offload == "cpu":
            locals_ = [GangAdamW._local(o) for _, o in opt._each()]
            moments = [s[k] for o in locals_ for s in o.state.values() for k in ("exp_avg", "exp_avg_sq")]
            report = {
                "deepspeed": all(isinstance(o, DeepSpeedCPUAdam) for o in locals_),
                "moments": len(moments),
                "on_host": all(
                    (m.to_local() if isinstance(m, DTensor) else m).device.type == "cpu" for m in moments
                ),
                "dtensor_state": any(isinstance(m, DTensor) for m in moments),
                "steps": sorted({float(s["step"]) for o in locals_ for s in o.state.values()}),
            }
    if rank == 0:
        torch.save(states, f"{out}.pt")
        Path(f"{out}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from grpo_trainer.tiny_model import TinyConfig, build_model, build_tokenizer

    out = tmp_path_factory.mktemp("model")
    build_model(TinyConfig(experts=4), build_tokenizer()).save_pretrained(out)
    return out


@pytest.mark.parametrize(("world", "ep", "sharding"), [(2, 1, "full"), (2, 2, "optimizer")])
def test_offloaded_adam_takes_torch_adamw_steps_with_host_state(
    model_dir: Path, tmp_path: Path, world: int, ep: int, sharding: str
) -> None:
    from tests.support.ports import free_port

    out = tmp_path / "out"
    start_ranks(worker, (world, ep, sharding, free_port(), str(model_dir), str(out)), world)
    states = torch.load(f"{out}.pt", weights_only=True)
    report = json.loads(Path(f"{out}.json").read_text())
    assert report["deepspeed"] and report["on_host"] and report["moments"] > 0
    assert report["steps"] == [float(STEPS)]
    assert report["dtensor_state"] == (sharding == "full")  # FSDP2 shards keep DTensor state
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    assert states["cpu"].keys() == states["none"].keys() == initial.keys()
    for name, tensor in states["none"].items():
        torch.testing.assert_close(states["cpu"][name], tensor, rtol=1e-5, atol=2e-5)
    moved = [n for n, t in initial.items() if not torch.allclose(states["cpu"][n], t, atol=1e-4)]
    assert len(moved) > len(initial) // 2  # the steps changed the weights: the comparison is not vacuous
