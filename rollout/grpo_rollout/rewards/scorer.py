"""Scores completions with the job's reward functions: a weighted sum that survives broken functions.

The rollout server calls `RewardScorer.score` once per generate request. Every function, built-in
or `module:function` plugin, runs in a `PluginWorker` child that is killed if it outlives
`reward.timeoutSeconds`, so a built-in fed a pathological completion is bounded like a plugin. A
function that raises, hangs, returns the wrong number of scores or a NaN scores the affected
samples 0 and says why in that sample's reward details; the server goes on.
When a batch call raises, each sample is retried alone (within the same time budget) so one bad
completion does not zero its whole batch. A sample no verdict was reached for in time scores 0 with
`timed_out` set in its detail: one the function returned as `Unjudged` (its own budget ran out), every
sample of a batch call past reward.timeoutSeconds, and those a retry did not reach in time.
With spec.reward.model, the reward model servers score the same completions (`model_client`, on a
thread of its own while the functions run) and join the sum by the model's weight, as the detail
named "model". Unlike a function's, their failure is not scored 0: a misconfigured model, or one no
server answers for, raises the client's `ServiceError`, which fails the /generate request.
"""

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grpo_operator.api.spec import RewardSpec
from grpo_wire.protocol import RewardDetail, ScoreItem

from grpo_rollout.rewards.base import Unjudged
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
            for i, detail in enumerate(self._run(name, weight, prompts, completions, columns)):
                rewards[i] += weight * detail.score
                details[i].append(detail)
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
        weight: float,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list[Any]],
    ) -> list[RewardDetail]:
        """One function's detail per completion."""
        total = len(completions)
        deadline = time.monotonic() + self.timeout
        call = self._worker.call

        def detail(score: float = 0.0, error: str | None = None, timed_out: bool = False) -> RewardDetail:
            return RewardDetail(name=name, weight=weight, score=score, error=error, timed_out=timed_out)

        try:
            return [
                detail(*v)
                for v in self._check(call(name, prompts, completions, columns, self.timeout), total)
            ]
        except PluginTimeout as e:  # a retry would not help: no verdict for the batch
            return self._failed(name, total, str(e), detail, timed_out=True)
        except BadScores as e:
            return self._failed(name, total, str(e), detail)
        except Exception as e:  # PluginError, or columns that are not JSON
            batch_error = e if isinstance(e, PluginError) else f"{type(e).__name__}: {e}"
        if total == 1:
            return self._failed(name, 1, str(batch_error), detail)
        # Retry sample by sample, so only the completions that break the function score 0.
        out = [detail(error=f"{batch_error} (batch call; not retried in time)", timed_out=True)] * total
        for i in range(total):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            one_cols = {k: [v[i]] for k, v in columns.items()}
            try:
                ((value, error, timed_out),) = self._check(
                    call(name, [prompts[i]], [completions[i]], one_cols, left), 1
                )
                out[i] = detail(value, error, timed_out)
            except PluginTimeout as e:
                out[i] = detail(error=str(e), timed_out=True)
                break
            except Exception as e:
                out[i] = detail(error=str(e) if isinstance(e, PluginError) else f"{type(e).__name__}: {e}")
        failed = sum(d.error is not None for d in out)
        if failed:
            log.warning("reward %s failed for %d of %d samples: %s", name, failed, total, batch_error)
        return out

    @staticmethod
    def _check(scores: Any, total: int) -> list[tuple[float, str | None, bool]]:
        """Validate a function's answer (right length, numbers or None, finite): (score, error, timed out)."""
        if not isinstance(scores, list | tuple) or len(scores) != total:
            got = len(scores) if isinstance(scores, list | tuple) else type(scores).__name__
            raise BadScores(f"returned {got} scores for {total} completions")
        verdicts: list[tuple[float, str | None, bool]] = []
        for v in scores:
            if isinstance(v, Unjudged):
                verdicts.append((0.0, v.reason or "returned Unjudged: no verdict", True))
                continue
            try:
                x = 0.0 if v is None else float(v)
            except (TypeError, ValueError):
                verdicts.append((0.0, f"returned a non-number: {v!r:.40}", False))
                continue
            finite = math.isfinite(x)
            verdicts.append((x, None, False) if finite else (0.0, f"returned {x}", False))
        return verdicts

    @staticmethod
    def _failed(
        name: str, total: int, reason: str, detail: Callable[..., RewardDetail], timed_out: bool = False
    ) -> list[RewardDetail]:
        log.warning("reward %s failed for all %d samples: %s", name, total, reason)
        return [detail(error=reason, timed_out=timed_out)] * total
