"""One GRPO optimizer step on real gloo ranks equals the same step on one process.

Spawns world = 2 with EP = 2 (experts sharded, all-to-all dispatch) and world = 2 with EP = 1
(pure data parallel), runs `grpo_trainer.step.Learner.train_step` on the same rollouts, gathers the
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

from tests.support import trainer_step as step

pytestmark = pytest.mark.slow
model_dir, reference = step.model_dir, step.reference  # the harness's module fixtures, by name
run_gang, assert_same_step = step.run_gang, step.assert_same_step

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


def initial_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()


def test_single_process_step_moves_toward_positive_advantages(reference: dict) -> None:
    assert reference["stats"]["kept"] == pytest.approx(9 / 12)
    assert reference["stats"]["grad_norm"] > 0
    assert reference["delta"] > 0  # sequence 0 scored best in its group: its log-prob rose


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
