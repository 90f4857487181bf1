"""A step's rollouts: from the rollout servers' answers to advantages and padded micro-batches.

Rank 0 turns the `grpo_rollout.client` results into a `Rollouts` (broadcast as safetensors
bytes, never pickled); every rank then calls `score` (rewards → advantages, which groups to keep),
takes its share with `shard`, and iterates `micro_batches`. Shapes: S sequences in the step,
b per micro-batch, L = longest prompt+completion in the micro-batch. With routing replay each
sequence also keeps the experts the rollout engine chose, laid out by `replay_routing` exactly
as the micro-batch's tokens are.
"""

import json
from dataclasses import dataclass

import safetensors.torch
import torch
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_rollout.protocol import PromptResult, Routing

from grpo_trainer.advantages import ADVANTAGES, overlong_penalty, zero_variance_mask


@dataclass
class Rollouts:
    """One step's sequences, prompt-major: sequence i belongs to prompt i // group_size."""

    group_size: int
    prompt_tokens: list[list[int]]  # [S][prompt length]
    completion_tokens: list[list[int]]  # [S][completion length], EOS included when it ended
    rollout_logprobs: list[list[float]]  # [S][completion length], under the sampling policy
    rewards: list[float]  # [S], weighted sum of the reward functions
    weight_version: int  # oldest weight version any of these were sampled with
    routing: list[torch.Tensor] | None = None  # [S][prompt + completion - 1, MoE layers, k] expert ids

    @classmethod
    def from_results(
        cls, results: list[PromptResult], group_size: int, weight_version: int, *, routing: bool = False
    ) -> "Rollouts":
        """routing: keep every completion's routing (routing replay); ValueError when one lacks it."""
        out = cls(group_size, [], [], [], [], weight_version, [] if routing else None)
        for r in results:
            if len(r.completions) != group_size:
                raise ValueError(
                    f"prompt {r.prompt_id}: {len(r.completions)} completions, expected {group_size}"
                )
            for c in r.completions:
                out.prompt_tokens.append(r.prompt_token_ids)
                out.completion_tokens.append(c.token_ids)
                out.rollout_logprobs.append(c.logprobs)
                out.rewards.append(c.reward)
                if out.routing is not None:
                    out.routing.append(decode_routing(r.prompt_id, c.routing))
        return out

    def __len__(self) -> int:
        return len(self.rewards)

    def to_bytes(self) -> bytes:
        """The rollouts as safetensors bytes (what rank 0 broadcasts): tensors and a JSON header,
        nothing a reader must unpickle."""
        tensors = {
            "prompt_tokens": _flat(self.prompt_tokens, torch.int64),
            "prompt_lengths": torch.tensor([len(t) for t in self.prompt_tokens], dtype=torch.int64),
            "completion_tokens": _flat(self.completion_tokens, torch.int64),
            "completion_lengths": torch.tensor([len(t) for t in self.completion_tokens], dtype=torch.int64),
            "rollout_logprobs": _flat(self.rollout_logprobs, torch.float64),
            "rewards": torch.tensor(self.rewards, dtype=torch.float64),
        }
        for i, r in enumerate(self.routing or []):
            tensors[f"routing.{i}"] = r.contiguous()
        header = {"group_size": self.group_size, "weight_version": self.weight_version}
        header["routing"] = self.routing is not None
        return safetensors.torch.save(tensors, metadata={"rollouts": json.dumps(header)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "Rollouts":
        header = json.loads(_safetensors_metadata(data)["rollouts"])
        t = safetensors.torch.load(data)
        prompt_lengths = t["prompt_lengths"].tolist()
        lengths = t["completion_lengths"].tolist()
        n = len(lengths)
        return cls(
            group_size=header["group_size"],
            prompt_tokens=_split(t["prompt_tokens"], prompt_lengths),
            completion_tokens=_split(t["completion_tokens"], lengths),
            rollout_logprobs=_split(t["rollout_logprobs"], lengths),
            rewards=t["rewards"].tolist(),
            weight_version=header["weight_version"],
            routing=[t[f"routing.{i}"] for i in range(n)] if header["routing"] else None,
        )

    def completion_tokens_total(self) -> int:
        return sum(len(c) for c in self.completion_tokens)


def _flat(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=dtype)


def _split(flat: torch.Tensor, lengths: list[int]) -> list[list]:
    return [chunk.tolist() for chunk in torch.split(flat, lengths)] if lengths else []


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The metadata of a safetensors byte string (its JSON header's __metadata__)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


def decode_routing(prompt_id: str, routing: Routing | None) -> torch.Tensor:
    """The wire routing as a [tokens, layers, k] tensor (uint8 or int16: 4-8x smaller than int64
    while it is broadcast to every rank)."""
    if routing is None:
        raise ValueError(
            f"prompt {prompt_id}: a completion came without routing, but algorithm.routingReplay needs it"
        )
    dtype = torch.uint8 if routing.dtype == "uint8" else torch.int16  # little-endian wire = host order
    return torch.frombuffer(bytearray(routing.raw()), dtype=dtype).view(routing.shape)


def score(rollouts: Rollouts, algo: AlgorithmSpec) -> tuple[torch.Tensor, list[int]]:
    """Advantages [S] and the indices of the sequences to train on (zero-variance groups dropped)."""
    rewards = torch.tensor(rollouts.rewards, dtype=torch.float64).view(-1, rollouts.group_size)  # [P, G]
    if algo.overlong_penalty is not None:
        lengths = torch.tensor([len(c) for c in rollouts.completion_tokens]).view_as(rewards)
        rewards = overlong_penalty(
            rewards,
            lengths,
            max_new_tokens=algo.max_new_tokens,
            buffer_tokens=algo.overlong_penalty.buffer_tokens,
            penalty=algo.overlong_penalty.penalty,
        )
    adv = ADVANTAGES[str(algo.advantage_normalization)](rewards)  # [P, G]
    keep = torch.ones(rewards.shape[0], dtype=torch.bool)
    if algo.filter_zero_variance_groups:
        keep = zero_variance_mask(rewards)
    kept = keep.repeat_interleave(rollouts.group_size).nonzero().flatten().tolist()
    return adv.flatten().float(), kept


def shard(indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's sequences: round-robin, so long and short completions spread evenly."""
    return indices[rank::world]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, L] prompt+completion, right-padded
    mask: torch.Tensor  # [b, L-1] 1.0 where position t predicts a completion token
    rollout_logp: torch.Tensor  # [b, L-1] sampling log-probs at those positions, 0 elsewhere
    advantages: torch.Tensor  # [b]
    routing: list[torch.Tensor] | None = None  # per MoE layer [b * L, k] experts to replay

    def to(self, device: torch.device) -> "MicroBatch":
        routing = None if self.routing is None else [t.to(device) for t in self.routing]
        return MicroBatch(
            *(t.to(device) for t in (self.input_ids, self.mask, self.rollout_logp, self.advantages)), routing
        )


def replay_routing(routes: list[torch.Tensor], width: int) -> list[torch.Tensor]:
    """Per MoE layer, the (b * width, k) experts for right-padded rows of `width` tokens, flattened
    as the MoE blocks flatten [b, L, H]. Each row's last token and its padding get -1 (no recorded
    choice): the router spreads those over all experts (`moe.router.spread_unrecorded`); any valid
    choice does, since no logit the loss keeps depends on them (causal attention)."""
    _, layers, k = routes[0].shape
    out = torch.full((len(routes), width, layers, k), -1, dtype=torch.int64)  # [b, L, layers, k]
    for row, r in enumerate(routes):
        out[row, : len(r)] = r
    return list(out.flatten(0, 1).unbind(1))  # layers x [b * L, k]


def collate(rollouts: Rollouts, indices: list[int], advantages: torch.Tensor, pad_id: int) -> MicroBatch:
    """Pad sequences to one length. An empty `indices` gives one all-masked dummy row: a rank with
    no sequences left still runs the forward/backward its EP peers' all-to-alls wait for."""
    if not indices:
        return MicroBatch(torch.full((1, 2), pad_id), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1))
    seqs = [rollouts.prompt_tokens[i] + rollouts.completion_tokens[i] for i in indices]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width - 1)
    logp = torch.zeros(len(seqs), width - 1)
    for row, (i, s) in enumerate(zip(indices, seqs, strict=True)):
        ids[row, : len(s)] = torch.tensor(s)
        p, c = len(rollouts.prompt_tokens[i]), len(rollouts.completion_tokens[i])
        mask[row, p - 1 : p - 1 + c] = 1.0  # logits at t predict token t+1
        logp[row, p - 1 : p - 1 + c] = torch.tensor(rollouts.rollout_logprobs[i])
    routing = None
    if rollouts.routing is not None:
        routing = replay_routing([rollouts.routing[i] for i in indices], width)
    return MicroBatch(ids, mask, logp, advantages[indices], routing)


def micro_batches(
    rollouts: Rollouts, mine: list[int], advantages: torch.Tensor, *, size: int, count: int, pad_id: int
) -> list[MicroBatch]:
    """Exactly `count` micro-batches of at most `size` sequences (the same count on every rank)."""
    return [collate(rollouts, mine[k * size : (k + 1) * size], advantages, pad_id) for k in range(count)]
