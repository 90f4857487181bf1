"""Warnings about the learning signal itself, decided once for every place that says them.

Trainer rank 0 measures each step how its episodes ended and how many reward judgements ran out of
time (`StepReport`: `metrics.episodes_cut_fraction`, `reward_timeouts_total`; `status.progress`:
`episodesCutFraction`, `rewardTimeouts`). A job whose episodes mostly hit the token budget, or whose
rewards score samples 0 for want of time, learns from a signal that is not the task's: that must be
said, once per job, never left for someone to find in a log. `warnings` is the one rule; the operator
posts each as a Warning Event (`controller.reconcile`), the trainer logs it and the local runtime
prints it, each remembering what it has said by reason.
"""

REWARD_TIMEOUTS = "RewardTimeouts"  # Event reasons
CUT_BY_BUDGET = "EpisodesCutByBudget"
MOST = 0.5  # a step whose episodes are cut past this share is warned about


def warnings(
    *, reward_timeouts: int | None, cut_fraction: float | None, max_new_tokens: int | None
) -> list[tuple[str, str]]:
    """(reason, message) for each signal a step's numbers show to be wrong; [] when none is.

    reward_timeouts: judgements out of time so far in the attempt; cut_fraction: the share of the
    step's episodes the budget ended; max_new_tokens: spec.algorithm.maxNewTokens, for the message."""
    out = []
    if reward_timeouts:
        out.append(
            (
                REWARD_TIMEOUTS,
                f"{reward_timeouts} reward judgement(s) ran out of time and scored 0 with no verdict "
                "(reward_timeouts in progress): give the rollout pods more CPU, raise "
                "spec.reward.timeoutSeconds, or make the reward cheaper on the inputs that time out",
            )
        )
    if cut_fraction is not None and cut_fraction > MOST:
        budget = f"={max_new_tokens}" if max_new_tokens is not None else ""
        out.append(
            (
                CUT_BY_BUDGET,
                f"{cut_fraction:.0%} of a step's episodes ended at the token budget "
                f"spec.algorithm.maxNewTokens{budget} (a turn cut there, or a tool's or environment's reply "
                "that did not fit): their rewards judge cut answers; raise spec.algorithm.maxNewTokens",
            )
        )
    return out
