"""One rank's policy and how a step updates it: GRPO's optimizer updates over the step's rollouts.

Called by the training loop (`grpo_trainer.loop`) once per step, on every rank, with the same
broadcast rollouts: `Learner.train_step` scores them (rewards -> advantages, `grpo_trainer.batch`),
takes this rank's share of each mini-batch, and makes epochsPerStep x miniBatchesPerStep updates,
each micro-batched forward/backward (`grpo_trainer.forward`, the loss of `grpo_trainer.losses`),
gradient sync (dense over the world, experts over expert-DP), clipping and an AdamW step.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from grpo_operator.api.algorithm import AlgorithmSpec
from torch import nn

from grpo_trainer import moe
from grpo_trainer.batch import MicroBatch, Rollouts, micro_batches, mini_batches, rank_plan, score
from grpo_trainer.config import MAX_GRAD_NORM, RankInfo
from grpo_trainer.forward import autocast, batch_logp, packs
from grpo_trainer.losses import LossConfig, Totals, grpo_loss
from grpo_trainer.optim import GangAdamW
from grpo_trainer.parallel import Groups, clip_gradients, sync_gradients


@dataclass(kw_only=True)
class Learner:
    """The policy (and KL reference) on this rank, its optimizer and loss: what a step updates."""

    algo: AlgorithmSpec
    info: RankInfo
    groups: Groups
    device: torch.device
    dtype: str  # spec.model.dtype: the autocast dtype
    model: nn.Module
    ref: nn.Module | None
    optimizer: GangAdamW
    loss_cfg: LossConfig
    pad_id: int

    def train_step(self, rollouts: Rollouts) -> dict[str, float | None]:
        """The step's optimizer updates: epochsPerStep passes over miniBatchesPerStep mini-batches.

        Each mini-batch is normalised by its own totals (over every rank) and every rank makes the
        same number of updates. With more than one update, π_old's log-probs come from one no-grad
        forward before the first (docs/objective.md); with one, π_old is the policy itself."""
        algo, info = self.algo, self.info
        advantages, kept = score(rollouts, algo)
        drawn = (
            {"extra_prompts": float(rollouts.prompts_drawn - algo.prompts_per_step)}
            if algo.dynamic_sampling
            else {}
        )
        drawn |= rollouts.episode_metrics() | rollouts.outcome_metrics()
        drawn["trained_samples"] = float(len(kept))
        if not kept:  # every group had equal rewards: nothing to learn, keep Adam's moments untouched
            return {"kept": 0.0, "loss": None, "grad_norm": None, **drawn}  # said, not missing
        plans = []  # per mini-batch: (its totals, this rank's micro-batches)
        for part in mini_batches(kept, algo.mini_batches_per_step):
            totals = Totals(
                tokens=float(sum(rollouts.model_tokens(i) for i in part)),
                sequences=float(len(part)),
                norm_len=float(algo.max_new_tokens),
            )
            packed = algo.max_tokens_per_micro_batch is not None and packs(self.model)
            plan = rank_plan(
                rollouts,
                part,
                info.rank,
                info.world_size,
                size=algo.micro_batch_size,
                max_tokens=algo.max_tokens_per_micro_batch,
                packed=packed,
            )
            plans.append(
                (totals, micro_batches(rollouts, plan, advantages, pad_id=self.pad_id, packed=packed))
            )
        updates = [plan for _ in range(algo.epochs_per_step) for plan in plans]
        if len(updates) > 1:
            self.old_logprobs([mb for _, batches in plans for mb in batches])
        results = [self.update(totals, batches) for totals, batches in updates]
        seen = [m for _, metrics, _ in results for m in metrics]
        keys = {k for m in seen for k in m}
        metrics = {
            k: sum(m[k] for m in seen if k in m) / sum(k in m for m in seen) for k in keys
        }  # this rank's
        loss = sum(float(loss) for loss, _, _ in results) / len(results)
        grad_norm = sum(norm for _, _, norm in results) / len(results)
        return {"loss": loss, "grad_norm": grad_norm, "kept": len(kept) / len(rollouts), **metrics, **drawn}

    def update(self, totals: Totals, batches: list[MicroBatch]) -> tuple[torch.Tensor, list[dict], float]:
        """One optimizer update: micro-batched loss/backward over this rank's share of a mini-batch,
        gradient sync, clip, AdamW step. Returns (loss over all ranks, this rank's metrics per
        non-empty micro-batch, gradient norm before clipping)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, seen = torch.zeros((), device=self.device), []
        for mb in batches:
            mb = mb.to(self.device)
            want_entropy = (
                self.loss_cfg.entropy_coef > 0 or not seen
            )  # else a metric of the first micro-batch
            # replay through backward too: activation checkpointing re-runs the routers there
            with moe.replaying(self.model, mb.routing):  # mb.routing None: route freely
                loss, mb_metrics = self.micro_step(mb, totals, entropy=want_entropy)
            loss_sum += loss.detach()
            if mb.mask.any():
                seen.append(mb_metrics)
        sync_gradients(self.model, self.groups)
        grad_norm = clip_gradients(self.model, self.groups, MAX_GRAD_NORM)
        self.optimizer.step()
        dist.all_reduce(loss_sum)
        return loss_sum, seen, grad_norm

    def micro_step(
        self, mb: MicroBatch, totals: Totals, *, entropy: bool
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward (policy, reference), loss and backward of one micro-batch; returns (loss, metrics)."""
        algo = self.algo
        with autocast(self.device, self.dtype):
            logp, ent = batch_logp(self.model, mb, algo.temperature, entropy=entropy)
        ref_logp = None
        if self.ref is not None:
            with (
                torch.no_grad(),
                moe.replaying(self.ref, mb.routing),
                autocast(self.device, self.dtype),
            ):
                ref_logp, _ = batch_logp(self.ref, mb, algo.temperature)
        if ent is not None and self.loss_cfg.entropy_coef == 0:
            ent = ent.detach()  # metric only (entropy collapse is GRPO's classic failure)
        loss, metrics = grpo_loss(
            self.loss_cfg,
            logp=logp,
            old_logp=logp.detach() if mb.old_logp is None else mb.old_logp,  # one update: π_old is π itself
            advantages=mb.advantages,
            mask=mb.mask,
            totals=totals,
            rollout_logp=mb.rollout_logp,
            ref_logp=ref_logp,
            entropy=ent,
        )
        loss.backward()
        return loss, metrics

    def old_logprobs(self, batches: list[MicroBatch]) -> None:
        """π_old's log-probs of every micro-batch, once, without gradient (the policy at the step's
        start): the denominator of every later update's ratio. Stored on each micro-batch."""
        algo = self.algo
        for mb in batches:
            dev = mb.to(self.device)
            with (
                torch.no_grad(),
                moe.replaying(self.model, dev.routing),
                autocast(self.device, self.dtype),
            ):
                mb.old_logp = batch_logp(self.model, dev, algo.temperature)[0].float()
