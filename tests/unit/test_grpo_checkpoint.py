"""Checkpoints: the pure choices (newest complete save, pruning, who writes a replicated tensor,
the marker), uid keying of the checkpoint folder, the multi-pod CEL rule, and on a real one-rank
gloo group an async save → resume round trip and the fallback past a damaged newest save."""

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_operator.api.status import Reason
from grpo_operator.validation import check_object
from grpo_trainer import checkpoint
from grpo_trainer.checkpoint import layout, state
from grpo_trainer.checkpoint.dcp_io import merge
from grpo_trainer.config import ConfigError, RankInfo

from tests.support.ports import free_port
from tests.support.rollout import build_tiny_model

INFO = RankInfo(rank=0, local_rank=0, world_size=1, pod_index=0, ep_size=1)


# --- pure logic -------------------------------------------------------------------------------


def test_newest_complete_save_first_and_incomplete_ones_never() -> None:
    assert layout.newest_first([4, 10, 6, 10]) == [10, 6, 4]
    assert layout.step_of("s3://b/ns/job-uid/step-00000012/") == 12
    assert layout.step_of("/ckpt/step-00000012.tmp") is None and layout.step_of("final") is None


def test_prune_keeps_the_newest_and_drops_crash_leftovers_but_never_the_current() -> None:
    old, stale = layout.to_prune([2, 4, 6], [5, 9], current=8, keep_last=2)
    assert old == [2, 4]  # 8 (just sealed) and 6 are kept
    assert stale == [5]  # an unsealed 9 is newer than this save: left alone
    assert layout.to_prune([], [], current=2, keep_last=1) == ([], [])


def test_marker_round_trip_and_refusals() -> None:
    s = layout.TrainState(step=8, version=9, position=32)
    body = layout.marker(s, world_size=2, ep_size=2, ranks={0: "a" * 64, 1: "b" * 64}, spec={})
    assert layout.parse_marker(body) == (s, {0: "a" * 64, 1: "b" * 64})
    with pytest.raises(ValueError, match="ranks"):
        layout.parse_marker(layout.marker(s, world_size=3, ep_size=1, ranks={0: "a"}, spec={}))
    with pytest.raises(ValueError):
        layout.parse_marker(b'{"format": "something else"}')


def test_each_replicated_tensor_has_exactly_one_writer_balanced_by_bytes() -> None:
    sizes = {"embed": 1000, "a": 10, "b": 10, "lm_head": 900, "norm": 1}
    who = state.assign(sizes, 2)
    assert who["embed"] != who["lm_head"]  # the two big ones go to different ranks
    assert state.assign(sizes, 2) == who  # deterministic: every replica agrees without talking
    assert set(state.assign(sizes, 1).values()) == {0}


def test_merged_metadata_reads_a_duplicated_chunk_from_the_loading_rank() -> None:
    def doc(rank: int) -> dict:
        chunk = {"offsets": [0], "sizes": [2], "file": f"rank-{rank}.distcp", "offset": 0, "length": 8,
                 "crc32": rank, "dtype": "torch.float32"}  # fmt: skip
        return {"rank": rank, "keys": {"w": {"dtype": "torch.float32", "size": [2], "chunks": [chunk]}}}

    md = merge([doc(0), doc(1)], prefer_rank=1)
    assert len(md.state_dict_metadata["w"].chunks) == 1
    assert next(iter(md.storage_data.values())).file == "rank-1.distcp"


# --- API: uid keying and the multi-pod rule ---------------------------------------------------


def job(**checkpoint_spec: object) -> GRPOJob:
    return GRPOJob.model_validate({
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "j"},
        "spec": {"model": {"path": "/m"}, "dataset": {"path": "/d.jsonl"},
                 "reward": {"functions": [{"builtin": "exact_match"}]}, "checkpoint": checkpoint_spec},
    })  # fmt: skip


def test_checkpoint_folder_is_keyed_by_the_jobs_uid() -> None:
    a = render.contract(job(path="s3://bkt/ck"), name="j", namespace="ns", uid="u-1")
    b = render.contract(job(path="s3://bkt/ck"), name="j", namespace="ns", uid="u-2")
    assert a.checkpoint_dir == "s3://bkt/ck/ns/j-u-1" and b.checkpoint_dir == "s3://bkt/ck/ns/j-u-2"
    pvc = render.contract(job(path="pvc://fsx/ck", resumeFrom="pvc://fsx/ck/ns/old-u-0"), name="j",
                          namespace="ns", uid="u")  # fmt: skip
    assert pvc.checkpoint_dir == "/mnt/pvc/fsx/ck/ns/j-u"
    assert pvc.spec.checkpoint.resume_from == "/mnt/pvc/fsx/ck/ns/old-u-0"


def spec_doc(replicas: int, **checkpoint_spec: object) -> dict:
    return {
        "apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "j"},
        "spec": {"model": {"path": "/m"}, "dataset": {"path": "/d.jsonl"},
                 "reward": {"functions": [{"builtin": "exact_match"}]},
                 "trainer": {"replicas": replicas}, "checkpoint": checkpoint_spec},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("replicas", "ckpt", "refused"),
    [(1, {}, False), (2, {}, True), (2, {"path": "/shared"}, True), (2, {"path": "s3://bkt/c"}, False),
     (2, {"path": "pvc://fsx/c"}, False)],
)  # fmt: skip
def test_more_than_one_trainer_pod_needs_s3_or_pvc(replicas: int, ckpt: dict, refused: bool) -> None:
    problems = [(".".join(map(str, path)), msg) for path, msg in check_object(spec_doc(replicas, **ckpt))]
    named = [p for p in problems if p[0] == "spec.checkpoint.path" and "s3:// or pvc://" in p[1]]
    assert bool(named) == refused, problems


# --- one rank, real gloo group ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gloo() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def policy(tiny: Path, seed: int):
    from grpo_trainer.optim import GangAdamW
    from grpo_trainer.parallel import Groups, load_policy

    groups = Groups(ep=None, expert_dp=None)
    model = load_policy(str(tiny), groups, "gloo", torch.device("cpu"))
    opt = GangAdamW(model, groups, lr=0.1, sharding="optimizer")
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def test_async_saves_resume_the_newest_and_fall_back_past_a_damaged_one(
    gloo: dist.ProcessGroup, tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = str(tmp_path / "ck")
    checkpoint.check_root(root, INFO)
    model, opt = policy(tiny, 0)
    saver = checkpoint.Saver(root, INFO, gloo, keep_last=2, spec={})
    for step in (2, 4, 6):
        saver.save(checkpoint.TrainState(step, step, 4 * step), checkpoint.gang_state(model, opt, INFO))
        if step == 4:
            expected = {k: v.clone() for k, v in model.state_dict().items()}
        for p in model.parameters():  # training goes on while the save is written: it holds a snapshot
            p.data.add_(1.0)
    saver.close()
    assert checkpoint.list_saves(root) == ([4, 6], [])  # keepLast 2 pruned step 2
    assert saver.last == (f"{root}/step-00000006", 6)

    (tmp_path / "ck" / "step-00000006" / "rank-00000.json").write_text("{}")  # damaged after sealing
    other, other_opt = policy(tiny, 1)
    with caplog.at_level(logging.WARNING):
        resumed = checkpoint.resume(root, None, other, other_opt, INFO, torch.device("cpu"))
    assert resumed is not None and resumed.state == checkpoint.TrainState(4, 4, 16)
    assert "step-00000006 is unreadable" in resumed.warnings[0] and "sha256" in resumed.warnings[0]
    assert "falling back" in caplog.text
    for k, v in other.state_dict().items():
        assert torch.equal(v, expected[k]), k

    (tmp_path / "ck" / "step-00000004" / "meta.json").write_text("torn")
    with pytest.raises(ConfigError, match="none of the 2 complete checkpoint"):
        checkpoint.resume(root, None, other, other_opt, INFO, torch.device("cpu"))


def test_resume_from_another_runs_save_only_while_the_job_has_none(
    gloo: dist.ProcessGroup, tiny: Path, tmp_path: Path
) -> None:
    model, opt = policy(tiny, 0)
    other_run = str(tmp_path / "other")
    saver = checkpoint.Saver(other_run, INFO, gloo, keep_last=1, spec={})
    saver.save(checkpoint.TrainState(3, 3, 12), checkpoint.gang_state(model, opt, INFO))
    saver.close()
    mine = str(tmp_path / "mine")
    fresh, fresh_opt = policy(tiny, 1)
    r = checkpoint.resume(mine, f"{other_run}/step-00000003", fresh, fresh_opt, INFO, torch.device("cpu"))
    assert r is not None and r.state.step == 3 and r.path.endswith("step-00000003")
    assert checkpoint.resume(mine, None, fresh, fresh_opt, INFO, torch.device("cpu")) is None

    own = checkpoint.Saver(mine, INFO, gloo, keep_last=1, spec={})
    own.save(checkpoint.TrainState(5, 5, 20), checkpoint.gang_state(fresh, fresh_opt, INFO))
    own.close()
    r = checkpoint.resume(mine, other_run, fresh, fresh_opt, INFO, torch.device("cpu"))
    assert r is not None and r.state.step == 5  # its own save wins over resumeFrom


def test_a_root_that_cannot_be_written_is_a_configuration_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"rank 0 \(pod 0\) cannot write"):
        checkpoint.check_root(str(blocker / "ck"), INFO)


def test_resume_from_a_checkpoint_path_loads_the_one_job_under_it_and_never_starts_fresh_silently(
    gloo: dist.ProcessGroup, tiny: Path, tmp_path: Path
) -> None:
    model, opt = policy(tiny, 0)
    old_path = tmp_path / "old"  # job A's checkpoint.path; its saves live in <path>/<ns>/<name>-<uid>
    saver = checkpoint.Saver(str(old_path / "ns" / "a-uid"), INFO, gloo, keep_last=1, spec={})
    saver.save(checkpoint.TrainState(3, 3, 12), checkpoint.gang_state(model, opt, INFO))
    saver.close()
    mine, cpu = str(tmp_path / "mine"), torch.device("cpu")
    fresh, fresh_opt = policy(tiny, 1)
    r = checkpoint.resume(mine, str(old_path), fresh, fresh_opt, INFO, cpu)
    assert r is not None and r.state.step == 3 and r.path == f"{old_path}/ns/a-uid/step-00000003"

    with pytest.raises(ConfigError, match=r"resumeFrom .*does not exist") as e:
        checkpoint.find_saves(mine, str(tmp_path / "typo"), INFO, cpu)
    assert e.value.reason == Reason.RESUME_FROM_NOT_FOUND

    (old_path / "ns" / "a-uid" / "step-00000003" / "rank-00000.json").write_text("{}")  # damaged
    with pytest.raises(ConfigError, match="none of its 1 complete checkpoint") as e:
        checkpoint.resume(mine, str(old_path), fresh, fresh_opt, INFO, cpu)
    assert e.value.reason == Reason.RESUME_FROM_UNREADABLE
    assert e.value.stated().startswith("ResumeFromUnreadable: spec.checkpoint.resumeFrom ")
