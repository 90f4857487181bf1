"""Scores completions with the job's reward functions: a weighted sum that survives broken functions.

The rollout server calls `RewardScorer.score` once per generate request. Every function, built-in
or `module:function` plugin, runs in a `PluginWorker` child that is killed if it outlives
`reward.timeoutSeconds`, so a built-in fed a pathological completion is bounded like a plugin. A
function that raises, hangs, returns the wrong number of scores or a NaN scores the affected
samples 0 and says why in that sample's reward details; the server goes on.
When a batch call raises, each sample is retried alone (within the same time budget) so one bad
completion does not zero its whole batch.
With spec.reward.model, the reward model servers score the same completions (`model_client`, on a
thread of its own while the functions run) and join the sum by the model's weight, as the detail
named "model". Unlike a function's, their failure is not scored 0: a misconfigured model, or one no
server answers for, raises the client's `ServiceError`, which fails the /generate request.
"""

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grpo_operator.api.spec import RewardSpec
from grpo_wire.protocol import RewardDetail, ScoreItem

from grpo_rollout.rewards.model_client import RewardModelClient
from grpo_rollout.rewards.worker import PluginError, PluginTimeout, PluginWorker

log = logging.getLogger(__name__)


class BadScores(Exception):
    """A reward function answered, but not with one number per completion."""


MODEL_DETAIL = "model"  # the reward model's RewardDetail name


class RewardScorer:
    def __init__(
        self, spec: RewardSpec, worker: PluginWorker | None = None, model: RewardModelClient | None = None
    ):
        self.timeout = spec.timeout_seconds
        self._worker = worker or PluginWorker()
        self.model = model
        self.model_weight = spec.model.weight if spec.model is not None else 0.0
        self._model_pool = ThreadPoolExecutor(1, thread_name_prefix="reward-model") if model else None
        # (name in the spec, weight): a built-in's name or 'module:function', both loaded by the worker
        self.functions: list[tuple[str, float]] = []
        for i, entry in enumerate(spec.functions):
            name = entry.builtin or entry.function
            assert name is not None  # the spec's CEL rule: exactly one of builtin/function
            try:  # a missing module or function fails the server at start-up, by field and name
                self._worker.check(name)
            except (PluginError, PluginTimeout) as e:
                field = f"spec.reward.functions[{i}].{'builtin' if entry.builtin else 'function'}"
                raise type(e)(f"{field}: {e}") from None
            self.functions.append((name, entry.weight))

    def close(self) -> None:
        self._worker.kill()
        if self._model_pool is not None:
            self._model_pool.shutdown(wait=False, cancel_futures=True)

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
    ) -> list[tuple[float, list[RewardDetail]]]:
        """(reward, details) per completion; columns are lists aligned with completions."""
        total = len(completions)
        rewards = [0.0] * total
        details: list[list[RewardDetail]] = [[] for _ in range(total)]
        asked = None
        if self.model is not None and self._model_pool is not None and total:
            items = [
                ScoreItem(
                    prompt=prompts[i],
                    completion=completions[i],
                    columns={k: v[i] for k, v in columns.items()},
                )
                for i in range(total)
            ]
            asked = self._model_pool.submit(self.model.score, items)
        for name, weight in self.functions:
            values, errors = self._run(name, prompts, completions, columns)
            for i in range(total):
                rewards[i] += weight * values[i]
                details[i].append(RewardDetail(name=name, weight=weight, score=values[i], error=errors[i]))
        if asked is not None:
            values, errors = asked.result()  # a misconfigured or unreachable model raises: no silent 0
            weight = self.model_weight
            for i in range(total):
                value = values[i] if math.isfinite(values[i]) else 0.0
                error = errors[i] if math.isfinite(values[i]) else f"the reward model answered {values[i]}"
                rewards[i] += weight * value
                details[i].append(RewardDetail(name=MODEL_DETAIL, weight=weight, score=value, error=error))
        return list(zip(rewards, details, strict=True))

    def _run(
        self,
        name: str,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list[Any]],
    ) -> tuple[list[float], list[str | None]]:
        total = len(completions)
        deadline = time.monotonic() + self.timeout
        call = self._worker.call
        try:
            return self._check(call(name, prompts, completions, columns, self.timeout), total)
        except (PluginTimeout, BadScores) as e:  # a retry would not help: zero the batch
            return self._failed(name, total, str(e))
        except Exception as e:  # PluginError, or columns that are not JSON
            batch_error = e if isinstance(e, PluginError) else f"{type(e).__name__}: {e}"
        if total == 1:
            return self._failed(name, 1, str(batch_error))
        # Retry sample by sample, so only the completions that break the function score 0.
        values: list[float] = [0.0] * total
        errors: list[str | None] = [f"{batch_error} (batch call; not retried in time)"] * total
        for i in range(total):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            one_cols = {k: [v[i]] for k, v in columns.items()}
            try:
                (values[i],), (errors[i],) = self._check(
                    call(name, [prompts[i]], [completions[i]], one_cols, left), 1
                )
            except PluginTimeout as e:
                errors[i] = str(e)
                break
            except Exception as e:
                errors[i] = str(e) if isinstance(e, PluginError) else f"{type(e).__name__}: {e}"
        failed = sum(err is not None for err in errors)
        if failed:
            log.warning("reward %s failed for %d of %d samples: %s", name, failed, total, batch_error)
        return values, errors

    @staticmethod
    def _check(scores: Any, total: int) -> tuple[list[float], list[str | None]]:
        """Validate a function's answer: right length, numbers or None, finite."""
        if not isinstance(scores, list | tuple) or len(scores) != total:
            got = len(scores) if isinstance(scores, list | tuple) else type(scores).__name__
            raise BadScores(f"returned {got} scores for {total} completions")
        values: list[float] = []
        errors: list[str | None] = []
        for v in scores:
            try:
                x = 0.0 if v is None else float(v)
            except (TypeError, ValueError):
                values.append(0.0)
                errors.append(f"returned a non-number: {v!r:.40}")
                continue
            finite = math.isfinite(x)
            values.append(x if finite else 0.0)
            errors.append(None if finite else f"returned {x}")
        return values, errors

    def _failed(self, name: str, total: int, reason: str) -> tuple[list[float], list[str | None]]:
        log.warning("reward %s failed for all %d samples: %s", name, total, reason)
        return [0.0] * total, [reason] * total
