"""A step's rollouts: from the rollout servers' answers to advantages and padded micro-batches.

Rank 0 turns the `grpo_wire.client` results into a `Rollouts` (broadcast as safetensors
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
from grpo_wire.protocol import PromptResult, Routing

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
    drawn: int | None = None  # prompts taken from the data for this step (dynamic sampling); None: S / G
    # multi-turn episodes: [S][completion length], 1 where the model sampled the token, 0 where a tool
    # wrote it (left out of the loss); [S] turns, tool calls and failed calls. None: single-turn.
    masks: list[list[int]] | None = None
    episodes: list[tuple[int, int, int]] | None = None
    # [S] how each sequence ended, for the step's report: the max_new_tokens budget ended it (a turn
    # cut there, or a reply that did not fit), and its reward judgements that ran out of time (scored
    # 0 without a verdict). None: not known (rollouts built by hand).
    cut: list[bool] | None = None
    reward_timeouts: list[int] | None = None

    @classmethod
    def from_results(
        cls, results: list[PromptResult], group_size: int, weight_version: int, *, routing: bool = False
    ) -> "Rollouts":
        """routing: keep every completion's routing (routing replay); ValueError when one lacks it."""
        out = cls(group_size, [], [], [], [], weight_version, [] if routing else None)
        multi = any(c.mask is not None for r in results for c in r.completions)
        out.masks, out.episodes = ([], []) if multi else (None, None)
        out.cut, out.reward_timeouts = [], []
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
                out.cut.append(c.finish_reason == "length")
                out.reward_timeouts.append(sum(d.timed_out for d in c.reward_details))
                if out.routing is not None:
                    out.routing.append(decode_routing(r.prompt_id, c.routing))
                if out.masks is not None and out.episodes is not None:
                    out.masks.append(c.mask if c.mask is not None else [1] * len(c.token_ids))
                    out.episodes.append((c.turns, c.tool_calls, c.tool_errors))
        return out

    def __len__(self) -> int:
        return len(self.rewards)

    @property
    def prompts_drawn(self) -> int:
        """Prompts this step consumed from the data: what the data position advances by."""
        return len(self) // self.group_size if self.drawn is None else self.drawn

    def first_groups(self, count: int) -> "Rollouts":
        """The first `count` groups (prompts), `drawn` kept."""
        s = slice(0, count * self.group_size)
        routing = None if self.routing is None else self.routing[s]
        return Rollouts(
            self.group_size,
            self.prompt_tokens[s],
            self.completion_tokens[s],
            self.rollout_logprobs[s],
            self.rewards[s],
            self.weight_version,
            routing,
            self.prompts_drawn,  # the dropped groups were drawn all the same
            None if self.masks is None else self.masks[s],
            None if self.episodes is None else self.episodes[s],
            None if self.cut is None else self.cut[s],
            None if self.reward_timeouts is None else self.reward_timeouts[s],
        )

    @classmethod
    def concat(cls, parts: "list[Rollouts]") -> "Rollouts":
        """Several draws as one step: groups in order, the oldest weight version, draws summed."""
        out = cls(parts[0].group_size, [], [], [], [], min(p.weight_version for p in parts))
        out.routing = None if parts[0].routing is None else []
        out.drawn = sum(p.prompts_drawn for p in parts)
        if any(p.masks is not None for p in parts):
            out.masks, out.episodes = [], []
        if all(p.cut is not None and p.reward_timeouts is not None for p in parts):
            out.cut, out.reward_timeouts = [], []
        for p in parts:
            if out.cut is not None and out.reward_timeouts is not None:
                out.cut += p.cut or []
                out.reward_timeouts += p.reward_timeouts or []
            if out.masks is not None and out.episodes is not None:
                out.masks += p.masks if p.masks is not None else [[1] * len(c) for c in p.completion_tokens]
                out.episodes += p.episodes if p.episodes is not None else [(1, 0, 0)] * len(p)
            out.prompt_tokens += p.prompt_tokens
            out.completion_tokens += p.completion_tokens
            out.rollout_logprobs += p.rollout_logprobs
            out.rewards += p.rewards
            if out.routing is not None:
                out.routing += p.routing or []
        return out

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
        if self.masks is not None and self.episodes is not None:
            tensors["masks"] = _flat(self.masks, torch.int8)
            tensors["episodes"] = torch.tensor(self.episodes, dtype=torch.int64).reshape(-1, 3)
        if self.cut is not None and self.reward_timeouts is not None:
            tensors["cut"] = torch.tensor(self.cut, dtype=torch.bool)
            tensors["reward_timeouts"] = torch.tensor(self.reward_timeouts, dtype=torch.int64)
        header = {"group_size": self.group_size, "weight_version": self.weight_version, "drawn": self.drawn}
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
            drawn=header.get("drawn"),
            masks=_split(t["masks"], lengths) if "masks" in t else None,
            episodes=[(a, b, c) for a, b, c in t["episodes"].tolist()] if "episodes" in t else None,
            cut=t["cut"].tolist() if "cut" in t else None,
            reward_timeouts=t["reward_timeouts"].tolist() if "reward_timeouts" in t else None,
        )

    def completion_tokens_total(self) -> int:
        return sum(len(c) for c in self.completion_tokens)

    def model_tokens(self, i: int) -> int:
        """Tokens of sequence i the policy sampled (a multi-turn episode's tool tokens left out)."""
        return len(self.completion_tokens[i]) if self.masks is None else sum(self.masks[i])

    def episode_metrics(self) -> dict[str, float]:
        """Multi-turn episodes' means (turns, tool calls per episode, failed calls, the share of
        completion tokens tools wrote); empty for single-turn rollouts."""
        if self.masks is None or self.episodes is None or not self.episodes:
            return {}
        n = len(self.episodes)
        tokens = self.completion_tokens_total()
        return {
            "turns_mean": sum(e[0] for e in self.episodes) / n,
            "tool_calls_per_episode": sum(e[1] for e in self.episodes) / n,
            "tool_errors": float(sum(e[2] for e in self.episodes)),
            "masked_token_fraction": 1 - sum(map(sum, self.masks)) / tokens if tokens else 0.0,
        }

    def outcome_metrics(self) -> dict[str, float]:
        """How the step's sequences ended: how many (and what share) the max_new_tokens budget cut,
        and how many reward judgements ran out of time (each scored 0 with no verdict). Empty when
        not known."""
        if self.cut is None or self.reward_timeouts is None or not self.cut:
            return {}
        cut = sum(self.cut)
        return {
            "episodes_cut_by_budget": float(cut),
            "episodes_cut_fraction": cut / len(self.cut),
            "reward_timeouts": float(sum(self.reward_timeouts)),
        }


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


def shaped_rewards(rollouts: Rollouts, algo: AlgorithmSpec) -> torch.Tensor:
    """The rewards advantages are computed from (overlong penalty applied): [P, G]."""
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
    return rewards


def effective_prefix(rollouts: Rollouts, need: int, algo: AlgorithmSpec) -> tuple[Rollouts, bool]:
    """Dynamic sampling's cut: the groups up to and including the `need`-th with unequal rewards
    (the rest are dropped, as DAPO does), and whether there were that many. Zero-variance groups
    before the cut stay in (they were drawn; `score` filters them), so exactly `need` groups train."""
    effective = zero_variance_mask(shaped_rewards(rollouts, algo)).nonzero().flatten().tolist()
    if len(effective) < need:
        return rollouts, False
    return rollouts.first_groups(effective[need - 1] + 1), True


def score(rollouts: Rollouts, algo: AlgorithmSpec) -> tuple[torch.Tensor, list[int]]:
    """Advantages [S] and the indices of the sequences to train on (zero-variance groups dropped)."""
    rewards = shaped_rewards(rollouts, algo)  # [P, G]
    adv = ADVANTAGES[str(algo.advantage_normalization)](rewards)  # [P, G]
    keep = torch.ones(rewards.shape[0], dtype=torch.bool)
    if algo.filter_zero_variance_groups:
        keep = zero_variance_mask(rewards)
    kept = keep.repeat_interleave(rollouts.group_size).nonzero().flatten().tolist()
    return adv.flatten().float(), kept


def untrained_reason(rollouts: Rollouts, algo: AlgorithmSpec) -> str:
    """Why `score` kept no sequence: every group's (shaped) rewards were equal, so no advantage; with
    what the step's outcome says about why (episodes cut by the budget, judgements out of time)."""
    rewards = shaped_rewards(rollouts, algo)  # [P, G]
    levels = sorted({round(float(r), 4) for r in rewards[:, 0].tolist()})
    shown = ", ".join(f"{v:g}" for v in levels[:4]) + (", ..." if len(levels) > 4 else "")
    why = (
        f"each of the {rewards.shape[0]} group(s) scored all its {rollouts.group_size} completions alike "
        f"(group rewards {shown}): no advantage to learn from (algorithm.filterZeroVarianceGroups)"
    )
    outcome = rollouts.outcome_metrics()
    if outcome.get("episodes_cut_fraction"):
        why += f"; {outcome['episodes_cut_fraction']:.0%} of episodes were cut by spec.algorithm.maxNewTokens"
    if outcome.get("reward_timeouts"):
        why += f"; {outcome['reward_timeouts']:.0f} reward judgement(s) ran out of time"
    return why


def shard(indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's sequences: round-robin, so long and short completions spread evenly."""
    return indices[rank::world]


def mini_batches(indices: list[int], count: int) -> list[list[int]]:
    """`count` contiguous slices of near-equal size (fewer when there are fewer indices): the
    sequences of each optimizer update. Every rank cuts the same global list the same way."""
    count = max(1, min(count, len(indices)))
    size, extra = divmod(len(indices), count)
    out, lo = [], 0
    for k in range(count):
        hi = lo + size + (k < extra)
        out.append(indices[lo:hi])
        lo = hi
    return out


def by_token_budget(indices: list[int], lengths: list[int], budget: int, *, packed: bool) -> list[list[int]]:
    """`indices` cut into micro-batches of at most `budget` tokens, longest first (a sequence longer
    than the budget goes alone). packed: end to end, first fit (no padding: the tokens are the real
    ones). Else padded rows of similar length: rows x longest row <= budget, so long-tailed
    completion lengths waste little padding."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: -lengths[i]):
        if packed:
            k = next((k for k, r in enumerate(room) if lengths[i] <= r), None)
        else:  # the open bin's rows are padded to its first (longest) sequence
            k = len(bins) - 1 if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget else None
        if k is None:
            bins.append([i])
            room.append(budget - lengths[i])
        else:
            bins[k].append(i)
            room[k] -= lengths[i]
    return bins


def rank_plan(
    rollouts: Rollouts,
    indices: list[int],
    rank: int,
    world: int,
    *,
    size: int,
    max_tokens: int | None,
    packed: bool = False,
) -> list[list[int]]:
    """This rank's micro-batches (sequence indices) of one mini-batch: its `shard`, cut into `size`
    sequences or, with `max_tokens`, by token budget; padded with empty ones to the count of the
    rank with the most, so every rank runs as many micro-steps (EP all-to-alls and FSDP
    collectives wait for every rank). Each rank computes every rank's cut: no communication."""
    lengths = [
        len(p) + len(c) for p, c in zip(rollouts.prompt_tokens, rollouts.completion_tokens, strict=True)
    ]
    plans = []
    for r in range(world):
        mine = shard(indices, r, world)
        if max_tokens is None:
            plans.append([mine[k : k + size] for k in range(0, len(mine), size)])
        else:
            plans.append(by_token_budget(mine, lengths, max_tokens, packed=packed))
    count = max(1, max(len(p) for p in plans))
    return plans[rank] + [[] for _ in range(count - len(plans[rank]))]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, L] prompt+completion, right-padded
    mask: torch.Tensor  # [b, L-1] 1.0 where position t predicts a completion token
    rollout_logp: torch.Tensor  # [b, L-1] sampling log-probs at those positions, 0 elsewhere
    advantages: torch.Tensor  # [b]
    routing: list[torch.Tensor] | None = None  # per MoE layer [b * L, k] experts to replay
    old_logp: torch.Tensor | None = None  # [b, L-1] under π_old (several updates per step); None: ratio 1
    # packed (see `pack`): input_ids/routing are one row [1, N] of b sequences end to end, position
    # ids restart at 0 for each (attention stays inside a sequence); `unpack` [b, L-1] indexes the
    # row's [N-1] next-token log-probs into the padded layout of mask/rollout_logp/old_logp
    position_ids: torch.Tensor | None = None  # [1, N]
    unpack: torch.Tensor | None = None  # [b, L-1]

    def to(self, device: torch.device) -> "MicroBatch":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        routing = None if self.routing is None else [t.to(device) for t in self.routing]
        tensors = (t.to(device) for t in (self.input_ids, self.mask, self.rollout_logp, self.advantages))
        return MicroBatch(*tensors, routing, *map(move, (self.old_logp, self.position_ids, self.unpack)))

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        """Per-position values of the forward ([b, L-1], or [1, N-1] when packed) in the padded
        [b, L-1] layout the loss reads; gradients flow through."""
        return packed if self.unpack is None else packed.reshape(-1)[self.unpack]


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
        # logits at t predict token t+1; a token a tool wrote is not the policy's: left out
        mask[row, p - 1 : p - 1 + c] = 1.0 if rollouts.masks is None else torch.tensor(rollouts.masks[i])
        logp[row, p - 1 : p - 1 + c] = torch.tensor(rollouts.rollout_logprobs[i])
    routing = None
    if rollouts.routing is not None:
        routing = replay_routing([rollouts.routing[i] for i in indices], width)
    return MicroBatch(ids, mask, logp, advantages[indices], routing)


def pack(rollouts: Rollouts, indices: list[int], advantages: torch.Tensor, pad_id: int) -> MicroBatch:
    """`collate`'s micro-batch with the sequences end to end in one row (no padding): position ids
    restart per sequence, which Hugging Face models turn into block-diagonal causal attention
    (flash-attention varlen, or a mask under SDPA/eager); `unpack` maps the row's log-probs back
    to the padded layout, so the loss sees exactly what it sees unpacked."""
    mb = collate(rollouts, indices, advantages, pad_id)  # mask, log-probs, advantages: padded [b, L-1]
    if not indices:
        return mb
    seqs = [rollouts.prompt_tokens[i] + rollouts.completion_tokens[i] for i in indices]
    starts = torch.tensor([0, *[len(s) for s in seqs]]).cumsum(0)[:-1].tolist()
    ids = torch.tensor([t for s in seqs for t in s]).unsqueeze(0)  # [1, N]
    positions = torch.cat([torch.arange(len(s)) for s in seqs]).unsqueeze(0)  # [1, N]
    width = mb.mask.shape[1]
    unpack = torch.zeros(len(seqs), width, dtype=torch.long)  # padding points at 0: masked anyway
    for row, (start, s) in enumerate(zip(starts, seqs, strict=True)):
        unpack[row, : len(s) - 1] = torch.arange(start, start + len(s) - 1)
    routing = None
    if rollouts.routing is not None:  # each sequence's routes with its last token unrecorded, end to end
        routes = [rollouts.routing[i] for i in indices]
        flat = [torch.cat([r.long(), torch.full((1, *r.shape[1:]), -1, dtype=torch.long)]) for r in routes]
        routing = replay_routing([torch.cat(flat)], ids.shape[1])
    return MicroBatch(ids, mb.mask, mb.rollout_logp, mb.advantages, routing, None, positions, unpack)


def micro_batches(
    rollouts: Rollouts, plan: list[list[int]], advantages: torch.Tensor, *, pad_id: int, packed: bool = False
) -> list[MicroBatch]:
    """One micro-batch per entry of `plan` (see `rank_plan`), padded or `pack`ed; an empty entry
    is a dummy row."""
    build = pack if packed else collate
    return [build(rollouts, indices, advantages, pad_id) for indices in plan]
