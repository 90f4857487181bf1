"""The export's pure parts: who writes which unit into which file, and the streamed safetensors file.

The plan spreads the bytes over the ranks, gives a unit only to a rank that holds it, numbers the
files rank by rank and starts a file when the next unit would pass the size bound; the streamed
file reads back through safetensors' own `safe_open` and refuses what its header did not announce.
"""

import io
from pathlib import Path

import pytest
import torch
from grpo_trainer.checkpoint import export_plan
from grpo_trainer.checkpoint.export_plan import Unit
from grpo_trainer.checkpoint.safetensors_stream import StreamWriter, TensorSpec
from safetensors import safe_open
from safetensors.torch import save

from tests.support.hf_files import tensors
from tests.support.model_configs import TINY


def unit(name: str, rows: int, holders: tuple[int, ...] = (), expert: int | None = None) -> Unit:
    return Unit(name, expert, ((name, (rows, 4)),), holders)


def test_experts_go_to_their_holders_and_the_bytes_spread():
    units = [unit("embed", 40)]  # gathered: any rank may write it
    units += [unit(f"e{e}", 10, holders=(e // 2,), expert=e) for e in range(4)]  # EP 2: experts 0-1 on rank 0
    units += [unit(f"norm{i}", 10, holders=(0, 1)) for i in range(4)]  # replicated
    p = export_plan.plan(units, world=2, itemsize=4, max_shard_bytes=1 << 20)
    assert [p.writer[u] for u in units[1:5]] == [0, 0, 1, 1]
    load = [sum(u.numel() * 4 for u in units if p.writer[u] == r) for r in range(2)]
    assert load == [960, 960]
    assert [f.name for f in p.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert set(p.weight_map()) == {u.source for u in units}


def test_files_stay_under_the_bound_and_a_large_unit_gets_its_own():
    units = [unit("a", 10, (0,)), unit("b", 10, (0,)), unit("big", 100, (0,)), unit("c", 10, (0,))]
    p = export_plan.plan(units, world=2, itemsize=4, max_shard_bytes=320)
    assert [[u.source for u in f.units] for f in p.files] == [["a", "b"], ["big"], ["c"]]
    assert all(f.writer == 0 for f in p.files) and p.of(1) == []


def test_a_unit_nobody_holds_or_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="no rank of 2 holds it"):
        export_plan.plan([unit("e9", 1, holders=(-1,), expert=9)], world=2, itemsize=4, max_shard_bytes=64)
    with pytest.raises(ValueError, match="names a tensor twice"):
        export_plan.plan([unit("a", 1), unit("a", 2)], world=1, itemsize=4, max_shard_bytes=64)


def test_a_streamed_file_reads_back_and_matches_safetensors_own(tmp_path: Path):
    tensors = {
        "w": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.float32),
        "m": torch.tensor([True, False, True]),
    }
    specs = [TensorSpec(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    with open(tmp_path / "s.safetensors", "wb") as f:
        w = StreamWriter(f, specs, {"format": "pt"})
        for k, t in tensors.items():
            assert not w.done()
            w.write(k, t)
        assert w.done()
    with safe_open(str(tmp_path / "s.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(torch.equal(f.get_tensor(k), t) for k, t in tensors.items())
    ours = (tmp_path / "s.safetensors").stat().st_size
    assert ours == len(save(tensors, metadata={"format": "pt"})), "same layout size as safetensors writes"


def test_the_stream_refuses_what_its_header_did_not_announce():
    w = StreamWriter(io.BytesIO(), [TensorSpec("a", (2,), torch.float32)], {})
    with pytest.raises(ValueError, match="expected"):
        w.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="expected"):
        w.write("a", torch.zeros(2, dtype=torch.bfloat16))
    w.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="all written"):
        w.write("b", torch.zeros(2))
    with pytest.raises(ValueError, match="no safetensors name"):
        StreamWriter(io.BytesIO(), [TensorSpec("c", (1,), torch.complex64)], {})


@pytest.mark.slow  # the first architecture pays transformers' model imports (15 s here)
@pytest.mark.parametrize("arch", sorted(TINY))
def test_every_supported_architecture_exports_what_save_pretrained_writes(arch: str, tmp_path: Path):
    """One rank, no process group: the units of an expert-parallel model (fused experts renumbered
    one by one, Mixtral's w1/w2/w3 and block_sparse_moe names, tied heads dropped) written by the
    export's own writer hold exactly save_pretrained's tensors of the same model."""
    from fsspec.implementations.local import LocalFileSystem
    from grpo_trainer import moe
    from grpo_trainer.checkpoint import export
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY[arch]())
    model.save_pretrained(tmp_path / "ref")
    ref = tensors(tmp_path / "ref")
    moe.expert_parallel(model, backend="local")
    holders = {
        name: [(0, m.experts.num_experts)] for name, m in model.named_modules() if isinstance(m, moe.MoELayer)
    }
    units = export.export_units(model, holders, world=1)
    plan = export_plan.plan(units, world=1, itemsize=4, max_shard_bytes=32 << 10)
    assert {n: s for u in units for n, s in u.outputs} == {k: tuple(t.shape) for k, t in ref.items()}
    (tmp_path / "new").mkdir()
    error, nbytes = export._write_files(
        model, units, plan, LocalFileSystem(), str(tmp_path / "new"), torch.float32, 0
    )
    assert error is None and nbytes == sum(t.numel() * 4 for t in ref.values())
    new = {}
    for f in plan.files:
        with safe_open(str(tmp_path / "new" / f.name), "pt") as st:
            new.update({k: st.get_tensor(k) for k in st.keys()})  # noqa: SIM118 - not a mapping
    assert sorted(new) == sorted(ref)
    assert all(torch.equal(new[k], t) for k, t in ref.items())
