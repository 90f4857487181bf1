"""One GRPO optimizer step on real gloo ranks equals the same step on one process.

Spawns world = 2 with EP = 2 (experts sharded, all-to-all dispatch) and world = 2 with EP = 1
(pure data parallel), runs `grpo_trainer.loop.train_step` on the same rollouts, gathers the
full state dict and compares it with a single-process step. SGD (not Adam) keeps the
comparison linear in the gradient, so it checks loss normalisation over micro-batches and
ranks (rank 1's 4 sequences in 2 micro-batches plus the all-masked one that keeps it in step
with rank 0's 3), gradient sync over the world and the expert-DP group, and the EP-aware global clip.
The single-process run also checks the direction: sequences with positive advantage gain
log-probability.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from grpo_operator import render
from grpo_operator.api.job import GRPOJob
from grpo_trainer import checkpoint, moe
from grpo_trainer.batch import Rollouts
from grpo_trainer.config import RankInfo
from grpo_trainer.loop import Run, forward_logp, train_step
from grpo_trainer.losses import LossConfig
from grpo_trainer.optim import GangAdamW
from grpo_trainer.parallel import load_policy, make_groups, split_parameters
from grpo_trainer.tiny_model import TinyConfig, build_model, build_tokenizer
from torch.distributed.tensor import DTensor

from tests.support.ports import free_port
from tests.support.ranks import start_ranks

pytestmark = pytest.mark.slow
GROUP = 3
# every loss option at once, with terms that have gradients at step 1 (k1 KL, entropy, GSPO ratio)
ALL_OPTIONS = {
    "policyLoss": "gspo",
    "lossAggregation": "sequence-mean",
    "advantageNormalization": "group-mean",
    "klCoef": 0.1,
    "klEstimator": "k1",
    "entropyCoef": 0.01,
    "overlongPenalty": {"bufferTokens": 2},
    "importanceSamplingCap": 1.5,
    "routingReplay": True,  # MoE layers at EP = 1 too (these rollouts carry no routing: free routing)
}


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
    model = load_policy(model_dir, groups, "gloo", cpu, replay=algo.routing_replay, sharding=sharding)
    lr = 1e-2
    opt = (
        torch.optim.SGD(model.parameters(), lr=1.0)
        if zero is None
        else GangAdamW(model, groups, lr=lr, zero_stage=zero)
    )
    ref = (
        load_policy(
            model_dir, groups, "gloo", cpu, replay=algo.routing_replay, sharding=sharding
        ).requires_grad_(False)
        if algo.kl_coef
        else None
    )
    run = Run(contract, info, groups, torch.device("cpu"), model, ref, opt, LossConfig.from_spec(algo),
              None, 0, checkpoint.TrainState(), None, None)  # fmt: skip
    data = rollouts()
    ids = torch.tensor([data.prompt_tokens[0] + data.completion_tokens[0]])
    before = forward_logp(model, ids, 1.0)[0].sum().item() if world == 1 else 0.0
    stats = train_step(run, data)
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


def initial_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    tok = build_tokenizer()
    build_model(TinyConfig(experts=4), tok).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_gang(model_dir, tmp_path_factory.mktemp("ref"), world=1, ep=1)


def test_single_process_step_moves_toward_positive_advantages(reference: dict) -> None:
    assert reference["stats"]["kept"] == pytest.approx(9 / 12)
    assert reference["stats"]["grad_norm"] > 0
    assert reference["delta"] > 0  # sequence 0 scored best in its group: its log-prob rose


def assert_same_step(got: dict, reference: dict) -> None:
    assert got["stats"]["loss"] == pytest.approx(reference["stats"]["loss"], rel=1e-4, abs=1e-6)
    assert got["stats"]["grad_norm"] == pytest.approx(reference["stats"]["grad_norm"], rel=1e-4)
    assert got["state"].keys() == reference["state"].keys()
    for name, tensor in reference["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (2, 1)])
def test_distributed_step_equals_single_process_step(
    model_dir: Path, tmp_path: Path, reference: dict, world: int, ep: int
) -> None:
    assert_same_step(run_gang(model_dir, tmp_path, world, ep), reference)


def test_every_loss_option_at_once_is_still_rank_invariant(model_dir: Path, tmp_path: Path) -> None:
    single = run_gang(model_dir, tmp_path / "one", 1, 1, ALL_OPTIONS)
    assert single["stats"]["kl"] == 0.0  # the reference is the initial policy
    assert single["stats"]["entropy"] > 0
    assert_same_step(run_gang(model_dir, tmp_path / "two", 2, 2, ALL_OPTIONS), single)


def test_zero1_shards_adam_state_and_takes_the_same_step(model_dir: Path, tmp_path: Path) -> None:
    plain = run_gang(model_dir, tmp_path, 2, 1, zero=0)
    zero = run_gang(model_dir, tmp_path, 2, 1, zero=1)
    assert 0 < zero["local_state"] < plain["local_state"]  # rank 0 keeps Adam moments for its part only
    for name, tensor in plain["state"].items():
        torch.testing.assert_close(zero["state"][name], tensor, rtol=0, atol=1e-7, msg=name)
    assert any(not torch.equal(t, zero["state"][n]) for n, t in initial_state(model_dir).items())


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (2, 1)])
def test_full_sharding_takes_the_same_step(model_dir: Path, tmp_path: Path, world: int, ep: int) -> None:
    """FSDP2 over the world (dense DTensors; experts by EP, and at world > EP also by FSDP over
    the expert data-parallel group), activation checkpointing per layer, every loss option: the
    same step as one process, gathered back to full HF tensors."""
    single = run_gang(model_dir, tmp_path / "one", 1, 1, ALL_OPTIONS)
    full = run_gang(model_dir, tmp_path / "full", world, ep, ALL_OPTIONS, sharding="full")
    assert (full["split"] > 0) == (world > ep)  # experts are DTensors exactly when there is expert-DP
    assert_same_step(full, single)


def test_full_sharding_with_adamw_matches_zero1(model_dir: Path, tmp_path: Path) -> None:
    """AdamW over FSDP2 DTensors (dense, and experts split over expert-DP: world 2, EP 1) = ZeRO-1's.

    FSDP2 reduce-scatters after every micro-batch while ZeRO-1 all-reduces the accumulated sum, so
    gradients differ by float summation order (about 1e-10 here); Adam's normalisation turns that
    into up to a few 1e-6 on weights whose gradient is near zero (routed experts): atol 1e-5, a
    thousandth of the lr 1e-2 step."""
    zero = run_gang(model_dir, tmp_path / "zero", 2, 1, zero=1)
    full = run_gang(model_dir, tmp_path / "full", 2, 1, zero=1, sharding="full")
    for name, tensor in zero["state"].items():
        torch.testing.assert_close(full["state"][name], tensor, rtol=1e-5, atol=1e-5, msg=name)
