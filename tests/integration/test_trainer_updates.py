"""Several optimizer updates per step, and token-budget micro-batches, on real gloo ranks.

Same harness as `test_trainer_step` (tests/support/trainer_step.py: the tiny MoE model, hand-made
rollouts, `train_step`, SGD unless AdamW is asked for): with miniBatchesPerStep x epochsPerStep
updates each mini-batch is normalised by its own totals over every rank, so world 2 takes the
single process's steps; the policy ratio to π_old moves after the first update, so tokens clip and
GSPO's sequence ratio gives another step than GRPO's; micro-batches cut by token budget (counts
evened out across ranks) give the fixed-size micro-batches' loss and gradient.
"""

from pathlib import Path

import pytest

from tests.support import trainer_step as step

pytestmark = pytest.mark.slow
model_dir, reference = step.model_dir, step.reference  # the harness's module fixtures, by name
run_gang, assert_same_step = step.run_gang, step.assert_same_step


def test_token_budget_micro_batches_take_the_same_step(
    model_dir: Path, tmp_path: Path, reference: dict
) -> None:
    """Length-sorted micro-batches of at most 14 padded tokens (1-3 sequences each, a different
    count per rank, evened out with empty ones for EP's all-to-alls): the loss and the SGD step
    (the gradient) are those of the fixed-size micro-batches."""
    assert_same_step(run_gang(model_dir, tmp_path, 2, 2, {"maxTokensPerMicroBatch": 14}), reference)


def test_several_updates_per_step_are_rank_invariant(model_dir: Path, tmp_path: Path) -> None:
    """2 epochs x 2 mini-batches: each mini-batch normalised by its own totals over both ranks."""
    options = {"miniBatchesPerStep": 2, "epochsPerStep": 2}
    single = run_gang(model_dir, tmp_path / "one", 1, 1, options)
    assert_same_step(run_gang(model_dir, tmp_path / "two", 2, 1, options), single)


def test_several_updates_make_the_ratio_clip_and_gspo_differ_from_grpo(
    model_dir: Path, tmp_path: Path
) -> None:
    """With one update per step the ratio is 1 and GSPO's step is GRPO's. With four (AdamW) the
    policy moves away from π_old between updates: tokens clip, and the sequence ratio gives a
    different step."""
    grpo = run_gang(model_dir, tmp_path / "grpo", 1, 1, {"miniBatchesPerStep": 4}, zero=0)
    gspo = run_gang(
        model_dir, tmp_path / "gspo", 1, 1, {"miniBatchesPerStep": 4, "policyLoss": "gspo"}, zero=0
    )
    assert grpo["stats"]["clip_frac"] > 0
    assert gspo["stats"]["clip_frac"] > 0
    moved = max((grpo["state"][n] - gspo["state"][n]).abs().max().item() for n in grpo["state"])
    assert moved > 1e-4
