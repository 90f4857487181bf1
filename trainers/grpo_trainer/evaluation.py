"""Held-out evaluation during training (`spec.dataset.eval`): rank 0 scores a fixed prompt set.

Called by the training loop on rank 0: before the first step (the baseline), every `everySteps`
steps and after the last, once the step's weights are live on the rollout servers. The servers
generate and score exactly as for training (same engine, same reward functions, same columns);
only the sampling differs: one greedy completion per prompt (temperature 0) gives `reward`, and
with `samples` = k > 0, k completions at the training temperature give pass@k. The k draws use
the same seed at every evaluation, so two evaluations differ by the policy, not by the dice.
Results wait in `Evaluator.finished` until the loop's next step report carries them
(`StepReport.evals`), which puts them in the progress lines, status.progress and the local
runtime's table, plot and summary.
"""

import logging
import time
from collections.abc import Callable

from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_operator.api.report import EvalScore
from grpo_operator.api.spec import DatasetSpec, EvalSpec
from grpo_wire.protocol import Prompt, Sampling

from grpo_trainer.data import Row, RowShape, load_rows
from grpo_trainer.generation import Generator

log = logging.getLogger(__name__)

SEED_SALT = 7_919  # keeps the pass@k draws apart from every training step's seed


def due(step: int, every: int, max_steps: int) -> bool:
    """Whether the policy after `step` steps is evaluated: the baseline, every `every`, the last."""
    return step == 0 or step % every == 0 or step == max_steps


def score(step: int, greedy: list[float], sampled: list[list[float]], seconds: float) -> EvalScore:
    """The evaluation's numbers: the greedy mean and, with k samples per prompt, the mean best-of-k."""
    k = len(sampled[0]) if sampled else 0
    return EvalScore(
        step=step,
        reward=sum(greedy) / len(greedy),
        pass_at_k=sum(max(rewards) for rewards in sampled) / len(sampled) if k else None,
        k=k,
        prompts=len(greedy),
        seconds=seconds,
    )


class Evaluator:
    """Rank 0's held-out set and the evaluations not yet reported."""

    def __init__(self, spec: EvalSpec, rows: list[Row], algo: AlgorithmSpec) -> None:
        self.spec = spec
        self.prompts = [Prompt.of(f"eval-{i}", r.prompt, r.columns) for i, r in enumerate(rows)]
        self._greedy = Sampling(temperature=0.0, max_new_tokens=algo.max_new_tokens)
        self._sampled = Sampling(
            temperature=algo.temperature,
            top_p=algo.top_p,
            max_new_tokens=algo.max_new_tokens,
            seed=algo.seed * 1_000_003 + SEED_SALT,
        )
        self.finished: list[EvalScore] = []

    @classmethod
    def for_dataset(
        cls,
        dataset: DatasetSpec,
        algo: AlgorithmSpec,
        check: Callable[[str, list[Row]], list[Row]] | None = None,
    ) -> "Evaluator | None":
        """The job's evaluator, its rows read and checked now (a bad set fails the job at start-up;
        `check`: the prompt check, `grpo_trainer.prompts.Checker`); None without `dataset.eval`."""
        if dataset.eval is None:
            return None
        field = "spec.dataset.eval.path"
        rows = load_rows(dataset.eval.path, RowShape.of(dataset), field)
        return cls(dataset.eval, check(field, rows) if check is not None else rows, algo)

    def due(self, step: int, max_steps: int) -> bool:
        return due(step, self.spec.every_steps, max_steps)

    def evaluate(self, generator: Generator, *, step: int, version: int) -> EvalScore:
        """Score the set with weights `version` (the policy after `step` steps); kept for the next report."""
        t0 = time.monotonic()
        greedy = [r[0] for r in generator.rewards(self.prompts, 1, self._greedy, min_version=version)]
        sampled = []
        if self.spec.samples:
            sampled = generator.rewards(self.prompts, self.spec.samples, self._sampled, min_version=version)
        result = score(step, greedy, sampled, time.monotonic() - t0)
        log.info(
            "eval at step %d: reward %.4f%s over %d prompts in %.1fs",
            step,
            result.reward,
            f", pass@{result.k} {result.pass_at_k:.4f}" if result.k else "",
            result.prompts,
            result.seconds,
        )
        self.finished.append(result)
        return result

    def take(self) -> list[EvalScore]:
        """The evaluations finished since the last call, oldest first."""
        taken, self.finished = self.finished, []
        return taken
