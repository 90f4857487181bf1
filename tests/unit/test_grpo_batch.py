"""From rollout results to advantages, shards and padded micro-batches."""

import pytest
import torch
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_trainer.batch import (
    Rollouts,
    by_token_budget,
    collate,
    effective_prefix,
    micro_batches,
    mini_batches,
    pack,
    rank_plan,
    score,
    shard,
)
from grpo_wire.protocol import Completion, PromptResult


def completion(tokens: list[int], reward: float) -> Completion:
    return Completion(
        text="", token_ids=tokens, logprobs=[-0.5 * (i + 1) for i in range(len(tokens))],
        finish_reason="stop", reward=reward,
    )  # fmt: skip


def rollouts() -> Rollouts:
    results = [
        PromptResult(
            prompt_id="0",
            prompt_token_ids=[5, 6],
            completions=[completion([7], 1.0), completion([8, 9, 1], 0.0)],
        ),
        PromptResult(
            prompt_id="1", prompt_token_ids=[4], completions=[completion([2, 1], 1.0), completion([3], 1.0)]
        ),
    ]
    return Rollouts.from_results(results, group_size=2, weight_version=3)


def test_from_results_is_prompt_major() -> None:
    r = rollouts()
    assert len(r) == 4 and r.weight_version == 3
    assert r.prompt_tokens == [[5, 6], [5, 6], [4], [4]]
    assert r.rewards == [1.0, 0.0, 1.0, 1.0]
    assert r.completion_tokens_total() == 7


def test_from_results_rejects_a_wrong_group_size() -> None:
    bad = PromptResult(prompt_id="0", prompt_token_ids=[1], completions=[completion([2], 0.0)])
    with pytest.raises(ValueError, match="1 completions, expected 2"):
        Rollouts.from_results([bad], group_size=2, weight_version=0)


def test_score_drops_zero_variance_groups() -> None:
    adv, kept = score(rollouts(), AlgorithmSpec(groupSize=2, advantageNormalization="group-mean"))
    assert kept == [0, 1]  # prompt 1's group (1, 1) carries no signal
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    _, kept_all = score(rollouts(), AlgorithmSpec(groupSize=2, filterZeroVarianceGroups=False))
    assert kept_all == [0, 1, 2, 3]


def test_score_applies_the_overlong_penalty_before_advantages() -> None:
    # maxNewTokens 3, buffer 2: lengths 1 -> 0, 3 -> -1 (full penalty), 2 -> -0.5, 1 -> 0
    algo = AlgorithmSpec(
        groupSize=2, maxNewTokens=3, overlongPenalty={"bufferTokens": 2}, advantageNormalization="group-mean"
    )
    adv, kept = score(rollouts(), algo)
    # shaped rewards [1, -1] and [0.5, 1]: both groups now have variance
    assert kept == [0, 1, 2, 3]
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -0.25, 0.25]))


def test_shard_is_round_robin() -> None:
    assert shard([0, 1, 2, 3, 4], rank=1, world=2) == [1, 3]
    assert shard([0], rank=1, world=2) == []


def test_collate_aligns_mask_and_logprobs_with_completion_tokens() -> None:
    r = rollouts()
    mb = collate(r, [1, 2], torch.tensor([0.1, 0.2, 0.3, 0.4]), pad_id=0)
    # seq 1: [5, 6 | 8, 9, 1]; seq 2: [4 | 2, 1] padded to 5
    assert mb.input_ids.tolist() == [[5, 6, 8, 9, 1], [4, 2, 1, 0, 0]]
    # logits at t predict token t+1: completion of seq 1 starts at t = 1, of seq 2 at t = 0
    assert mb.mask.tolist() == [[0, 1, 1, 1], [1, 1, 0, 0]]
    assert mb.rollout_logp.tolist() == [[0, -0.5, -1.0, -1.5], [-0.5, -1.0, 0, 0]]
    assert mb.advantages.tolist() == pytest.approx([0.2, 0.3])


def test_micro_batches_pad_with_masked_dummies_to_the_same_count() -> None:
    r = rollouts()
    adv = torch.zeros(4)
    batches = micro_batches(r, [[3], [], []], adv, pad_id=0)
    assert len(batches) == 3
    assert batches[0].mask.sum() == 1
    assert all(b.mask.sum() == 0 and b.input_ids.shape == (1, 2) for b in batches[1:])


@pytest.mark.parametrize("with_routing", [False, True])
def test_rollouts_travel_as_safetensors_bytes_exactly(with_routing: bool) -> None:
    r = rollouts()
    if with_routing:  # [prompt + completion - 1, layers, k] per sequence, uint8 or int16 on the wire
        r.routing = [
            torch.randint(0, 200, (len(p) + len(c) - 1, 2, 2), dtype=torch.uint8 if i % 2 else torch.int16)
            for i, (p, c) in enumerate(zip(r.prompt_tokens, r.completion_tokens, strict=True))
        ]
    r.rollout_logprobs[0][0] = -1.2345678901234567  # float64: no precision lost on the way
    data = r.to_bytes()
    assert b"__reduce__" not in data and not data.startswith(b"\x80")  # no pickle anywhere
    back = Rollouts.from_bytes(data)
    assert back.prompt_tokens == r.prompt_tokens and back.completion_tokens == r.completion_tokens
    assert back.rollout_logprobs == r.rollout_logprobs and back.rewards == r.rewards
    assert (back.group_size, back.weight_version) == (r.group_size, r.weight_version)
    if with_routing:
        assert all(
            torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(back.routing, r.routing, strict=True)
        )
    else:
        assert back.routing is None


def test_mini_batches_are_contiguous_near_equal_slices() -> None:
    assert mini_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert mini_batches([4, 5], 4) == [[4], [5]]  # never an empty update


def test_token_budget_packs_longest_first_into_the_first_bin_with_room() -> None:
    lengths = [3, 9, 4, 20, 5, 3]
    batches = by_token_budget(list(range(6)), lengths, budget=12, packed=True)
    assert batches == [[3], [1, 0], [4, 2, 5]]  # 20 alone, over budget; 9 + 3; 5 + 4 + 3
    assert all(sum(lengths[i] for i in b) <= 12 for b in batches if len(b) > 1)


def test_token_budget_pads_rows_of_similar_length_under_the_budget() -> None:
    lengths = [3, 9, 4, 20, 5, 3]
    batches = by_token_budget(list(range(6)), lengths, budget=10, packed=False)
    assert batches == [[3], [1], [4, 2], [0, 5]]  # 20 alone, over budget; 5 and 4 padded to 2 x 5
    assert all(len(b) * max(lengths[i] for i in b) <= 10 for b in batches if len(b) > 1)


@pytest.mark.parametrize("max_tokens", [None, 4])
def test_rank_plan_gives_every_rank_the_same_count(max_tokens: int | None) -> None:
    r = rollouts()  # sequence lengths 3, 5, 3, 2
    plans = [rank_plan(r, [0, 1, 2, 3], k, 3, size=1, max_tokens=max_tokens, packed=True) for k in range(3)]
    assert len({len(p) for p in plans}) == 1
    assert sorted(i for p in plans for b in p for i in b) == [0, 1, 2, 3]
    assert plans[2] == [[2], []]  # rank 2 holds one sequence: one empty micro-batch keeps it in step


def test_effective_prefix_cuts_after_the_needed_groups_with_a_signal() -> None:
    r = Rollouts.concat([rollouts(), rollouts()])  # groups: signal, saturated, signal, saturated
    algo = AlgorithmSpec(groupSize=2)
    cut, full = effective_prefix(r, 2, algo)
    assert full and len(cut) == 3 * 2  # the saturated group between the two stays (score drops it)
    assert cut.prompts_drawn == 4  # the dropped last group was drawn all the same
    assert len(score(cut, algo)[1]) == 2 * 2
    _, short = effective_prefix(r, 3, algo)
    assert not short


def test_drawn_prompts_travel_with_the_rollouts() -> None:
    r = Rollouts.concat([rollouts(), rollouts()]).first_groups(1)
    back = Rollouts.from_bytes(r.to_bytes())
    assert back.prompts_drawn == 4 and len(back) == 2
    assert Rollouts.from_bytes(rollouts().to_bytes()).prompts_drawn == 2


def test_pack_lays_sequences_end_to_end_with_their_routing() -> None:
    r = rollouts()
    pairs = zip(r.prompt_tokens, r.completion_tokens, strict=True)
    r.routing = [
        torch.full((len(p) + len(c) - 1, 1, 2), i, dtype=torch.uint8) for i, (p, c) in enumerate(pairs)
    ]
    mb = pack(r, [1, 2], torch.tensor([0.1, 0.2, 0.3, 0.4]), pad_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 8, 9, 1, 4, 2, 1]]  # seq 1 (5 tokens), seq 2 (3 tokens)
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert mb.mask.tolist() == collate(r, [1, 2], torch.zeros(4), pad_id=0).mask.tolist()  # padded layout
    assert mb.unpack.tolist() == [[0, 1, 2, 3], [5, 6, 0, 0]]  # position t of each: its row index
    (layer,) = mb.routing  # [8 tokens, k]: each sequence's own routes, its last token unrecorded
    assert layer[:, 0].tolist() == [1, 1, 1, 1, -1, 2, 2, -1]
