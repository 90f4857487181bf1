"""Sharded loading on real gloo ranks: each rank reads from safetensors only the tensors it keeps.

`grpo_trainer.parallel.load_policy` builds the model on the meta device, applies EP (and FSDP2
under `sharding: full`: dense rows over the world, whole experts over the ranks sharing an EP
block), then fills only local tensors. Each rank here counts the bytes its
`safe_open` handles return (a wrapper installed by the test, independent of the loader's own
count) and gathers the loaded model back to full HF tensors, which must equal `from_pretrained`.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from tests.support.ports import free_port
from tests.support.ranks import start_ranks

pytestmark = pytest.mark.slow


class CountingHandle:
    """safe_open handle counting the bytes of every tensor it returns."""

    def __init__(self, handle, counter: list[int]) -> None:
        self.handle, self.counter = handle, counter

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, key):
        t = self.handle.get_tensor(key)
        self.counter[0] += t.numel() * t.element_size()
        return t

    def get_slice(self, key):
        sl, counter = self.handle.get_slice(key), self.counter

        class Slice:
            def __getitem__(self, index):
                t = sl[index]
                counter[0] += t.numel() * t.element_size()
                return t

        return Slice()


def worker(rank: int, world: int, ep: int, sharding: str, port: int, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from grpo_trainer import loading, moe
    from grpo_trainer.config import RankInfo
    from grpo_trainer.parallel import load_policy, make_groups

    counter = [0]
    loading.safe_open = lambda path, framework: CountingHandle(safe_open(path, framework), counter)
    groups = make_groups(RankInfo(rank=rank, local_rank=rank, world_size=world, pod_index=0, ep_size=ep))
    model = load_policy(model_dir, groups, "gloo", torch.device("cpu"), sharding=sharding)
    read = counter[0]
    state = moe.full_state_dict(model)
    counts = [None] * world
    dist.all_gather_object(counts, read)
    if rank == 0:
        torch.save({"state": state, "read": counts}, out)
    dist.barrier()
    dist.destroy_process_group()


def split_bytes(model_dir: Path) -> tuple[int, int]:
    """(expert bytes, dense bytes) of the checkpoint files."""
    expert = dense = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118
                t = f.get_tensor(key)
                n = t.numel() * t.element_size()
                if ".experts." in key:
                    expert += n
                else:
                    dense += n
    return expert, dense


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from grpo_trainer.tiny_model import TinyConfig, build_model, build_tokenizer

    out = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    build_model(TinyConfig(experts=8, expert_width=128), tok).save_pretrained(out)
    return out


@pytest.mark.parametrize(("world", "ep", "sharding"), [(4, 4, "full"), (2, 2, "optimizer"), (4, 2, "full")])
def test_each_rank_reads_only_what_it_keeps(
    model_dir: Path, tmp_path: Path, world: int, ep: int, sharding: str
) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out.pt"
    args = (world, ep, sharding, free_port(), str(model_dir), str(out))
    start_ranks(worker, args, world)
    got = torch.load(out, weights_only=False)
    expert, dense = split_bytes(model_dir)
    full = sharding == "full"  # dense rows split over the world, experts over EP and then over expert-DP
    dense_share, expert_share = (dense / world, expert / world) if full else (dense, expert / ep)
    for rank, read in enumerate(got["read"]):
        share = expert_share + dense_share
        assert read == pytest.approx(share, rel=0.05), (rank, read, share, json.dumps(got["read"]))
        assert read < expert + dense  # never the whole model
    if full:  # the chunks of all ranks cover each tensor, dense and expert, exactly once
        assert sum(got["read"]) == pytest.approx(expert + dense, rel=1e-6)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    assert got["state"].keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=0, atol=0, msg=name)
