"""The one-step harness of the trainer-step tests: hand-made rollouts, a `train_step` on real gloo
ranks of the tiny MoE model (4 experts), the full state gathered afterwards for comparison.

SGD unless AdamW is asked for (`zero`): a step linear in the gradient, so a distributed step
must equal the single process's to float rounding. `model_dir` and `reference` (the world-1
step) are module fixtures, shared by name with the modules that bind them.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_trainer import moe
from grpo_trainer.batch import Rollouts
from grpo_trainer.config import RankInfo
from grpo_trainer.forward import forward_logp
from grpo_trainer.losses import LossConfig
from grpo_trainer.optim import GangAdamW
from grpo_trainer.parallel import load_policy, make_groups, split_parameters
from grpo_trainer.step import Learner
from grpo_trainer.tiny_model import TinyConfig, save_untrained
from torch.distributed.tensor import DTensor

from tests.support.ports import free_port
from tests.support.ranks import start_ranks

GROUP = 3


def rollouts() -> Rollouts:
    """4 prompts x 3 completions; prompt 2's group has equal rewards (filtered): 9 sequences train."""
    gen = torch.Generator().manual_seed(0)
    r = Rollouts(GROUP, [], [], [], [], weight_version=0)
    rewards = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]
    for p in range(4):
        prompt = torch.randint(3, 90, (2 + p,), generator=gen).tolist()
        for g in range(GROUP):
            n = 1 + (p + g) % 4
            r.prompt_tokens.append(prompt)
            r.completion_tokens.append(torch.randint(3, 90, (n,), generator=gen).tolist())
            r.rollout_logprobs.append((-torch.rand(n, generator=gen) * 4 - 1).tolist())
            r.rewards.append(rewards[p][g])
    return r


def make_contract(model_dir: Path, world: int, ep: int, options: dict):
    spec = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "dataset": {"path": "/unused.jsonl"},
        "reward": {"functions": [{"builtin": "exact_match"}]},
        "algorithm": {
            "groupSize": GROUP,
            "promptsPerStep": 4,
            "microBatchSize": 2,
            "maxNewTokens": 4,
            **options,
        },
        "trainer": {"replicas": 1, "processesPerPod": world, "expertParallelSize": ep},
    }
    job = GRPOJob.model_validate(
        {"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob", "metadata": {"name": "s"}, "spec": spec}
    )
    return render.contract(job, name="s", namespace="t", local_ports=render.LocalPorts(1, (2,)))


def worker(
    rank: int,
    world: int,
    ep: int,
    port: int,
    model_dir: str,
    out: str,
    options: dict,
    zero: int | None,
    sharding: str = "optimizer",
) -> None:
    """One rank: a train_step with SGD (zero None) or with the gang's AdamW at ZeRO stage `zero`;
    `sharding` "full": the model FSDP2-sharded (and checkpointed per layer) as the trainer loads it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    contract = make_contract(Path(model_dir), world, ep, options)
    info = RankInfo(rank=rank, local_rank=rank, world_size=world, pod_index=0, ep_size=ep)
    groups = make_groups(info)
    algo = contract.spec.algorithm
    cpu = torch.device("cpu")
    model = load_policy(model_dir, groups, "gloo", cpu, sharding=sharding)
    lr = 1e-2
    opt = (
        torch.optim.SGD(model.parameters(), lr=1.0)
        if zero is None
        else GangAdamW(model, groups, lr=lr, sharding="optimizer" if zero else "none")
    )
    ref = (
        load_policy(model_dir, groups, "gloo", cpu, sharding=sharding).requires_grad_(False)
        if algo.kl_coef
        else None
    )
    dtype = str(contract.spec.model.dtype)
    learner = Learner(
        algo=algo, info=info, groups=groups, device=torch.device("cpu"), dtype=dtype, model=model, ref=ref,
        optimizer=opt, loss_cfg=LossConfig.from_spec(algo), pad_id=0,
    )  # fmt: skip
    data = rollouts()
    ids = torch.tensor([data.prompt_tokens[0] + data.completion_tokens[0]])
    before = forward_logp(model, ids, 1.0)[0].sum().item() if world == 1 else 0.0
    stats = learner.train_step(data)
    state = moe.full_state_dict(model)  # collective (FSDP2: every rank gathers each DTensor)
    if rank == 0:
        after = forward_logp(model, ids, 1.0)[0].sum().item() if world == 1 else 0.0
        local = opt.local_state_size() if zero is not None else 0
        split = sum(isinstance(p, DTensor) for p in split_parameters(model)[1])  # experts FSDP-sharded
        torch.save(
            {"state": state, "stats": stats, "delta": after - before, "local_state": local, "split": split},
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


def run_gang(
    model_dir: Path,
    tmp: Path,
    world: int,
    ep: int,
    options: dict | None = None,
    zero: int | None = None,
    sharding: str = "optimizer",
) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / f"w{world}-ep{ep}-z{zero}-{sharding}.pt"
    args = (world, ep, free_port(), str(model_dir), str(out), options or {}, zero, sharding)
    start_ranks(worker, args, world)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_untrained(tmp_path_factory.mktemp("model"), TinyConfig(experts=4))


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_gang(model_dir, tmp_path_factory.mktemp("ref"), world=1, ep=1)


def assert_same_step(got: dict, reference: dict) -> None:
    assert got["stats"]["loss"] == pytest.approx(reference["stats"]["loss"], rel=1e-4, abs=1e-6)
    assert got["stats"]["grad_norm"] == pytest.approx(reference["stats"]["grad_norm"], rel=1e-4)
    assert got["state"].keys() == reference["state"].keys()
    for name, tensor in reference["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
