"""The rollout servers' client of the reward model servers (spec.reward.model): POST /score in batches.

`RewardModelClient.score` splits a request's completions into batches of reward.model.batchSize and
scores them concurrently over the replicas (contract.reward.endpoints): one worker per replica takes
the next batch from a shared queue, so a free replica takes what a failed or slow one gave back. A
batch that fails on a replica (connection refused, 5xx, past timeoutSeconds) goes back to the queue
for another replica; the failing replica backs off (doubling, to BACKOFF_MAX_S) before it takes
another batch, so a lost pod costs latency while its replacement starts, no completion is dropped.
Nothing is scored 0 silently: a 422 `reward_misconfigured` (or any other refusal no retry fixes)
raises `RewardModelMisconfigured` at once, and batches still unscored after DEADLINE_FACTOR x
timeoutSeconds raise `RewardModelUnavailable`; both are `ServiceError`s, which the rollout server's
/generate answers with (`grpo_rollout.service`).
"""

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

import aiohttp
from grpo_wire.protocol import (
    AUTH_HEADER,
    REWARD_MISCONFIGURED,
    REWARD_UNAVAILABLE,
    ErrorResponse,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
)
from pydantic import ValidationError

from grpo_rollout.errors import ServiceError

log = logging.getLogger(__name__)

DEADLINE_FACTOR = 3.0  # a request's batches get this many timeoutSeconds in all
BACKOFF_S, BACKOFF_MAX_S = 0.25, 5.0
RETRIABLE = {408, 409, 429, 500, 502, 503, 504}


class RewardModelMisconfigured(ServiceError):
    def __init__(self, message: str):
        super().__init__(422, REWARD_MISCONFIGURED, message)


class RewardModelUnavailable(ServiceError):
    def __init__(self, message: str):
        super().__init__(502, REWARD_UNAVAILABLE, message, retry_after=5)


class Retry(Exception):
    """One batch failed on one replica for a reason another replica (or a later try) may not have."""


@dataclass(frozen=True)
class ModelClientConfig:
    """The job's reward model servers and how they are asked."""

    endpoints: tuple[str, ...]  # contract.reward.endpoints
    token: str  # the job's token
    batch_size: int = 16  # spec.reward.model.batchSize
    timeout_s: float = 120.0  # spec.reward.model.timeoutSeconds: one batch on one replica

    @property
    def deadline_s(self) -> float:
        return DEADLINE_FACTOR * self.timeout_s


class RewardModelClient:
    def __init__(self, config: ModelClientConfig):
        if not config.endpoints:
            raise ValueError(
                "spec.reward.model is set but the run contract lists no reward servers (contract.reward)"
            )
        self.config = config
        self.retries = 0  # batches sent again after a failure (for tests and logs)

    def score(self, items: list[ScoreItem]) -> tuple[list[float], list[str | None]]:
        """One (score, error) per item, in order; blocks (the rollout's reward thread calls it)."""
        if not items:
            return [], []
        return asyncio.run(self._score(items))

    async def _score(self, items: list[ScoreItem]) -> tuple[list[float], list[str | None]]:
        size = self.config.batch_size
        batches = [items[i : i + size] for i in range(0, len(items), size)]
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(batches)):
            queue.put_nowait(i)
        answers: dict[int, ScoreResponse] = {}
        last_error: dict[str, str] = {}
        all_done = asyncio.Event()
        deadline = time.monotonic() + self.config.deadline_s

        async def worker(session: aiohttp.ClientSession, ep: str) -> None:
            backoff = 0.0
            while True:
                i = await queue.get()
                try:
                    answers[i] = await self._post(session, ep, batches[i], deadline)
                except Retry as e:
                    last_error[ep] = str(e)
                    self.retries += 1
                    queue.put_nowait(i)  # another replica's worker takes it
                    backoff = min(BACKOFF_MAX_S, max(BACKOFF_S, 2 * backoff))
                    log.warning(
                        "reward server %s: %s; its batch goes to another (%.2fs backoff)", ep, e, backoff
                    )
                    await asyncio.sleep(backoff)
                    continue
                backoff = 0.0
                if len(answers) == len(batches):
                    all_done.set()

        async with aiohttp.ClientSession() as session:
            workers = [asyncio.ensure_future(worker(session, ep)) for ep in self.config.endpoints]
            waiter = asyncio.ensure_future(all_done.wait())
            try:
                left = max(0.0, deadline - time.monotonic())
                await asyncio.wait({waiter, *workers}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for w in workers:  # a worker ends only by raising: a refusal no retry fixes
                    if w.done():
                        w.result()
            finally:
                for task in (waiter, *workers):
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.gather(waiter, *workers, return_exceptions=True)
        if len(answers) < len(batches):
            missing = sum(len(batches[i]) for i in range(len(batches)) if i not in answers)
            why = "\n".join(f"  {ep}: {e}" for ep, e in last_error.items()) or "  (no answer in time)"
            raise RewardModelUnavailable(
                f"the reward model servers (spec.reward.model) did not score {missing} of {len(items)} "
                f"completion(s) within {self.config.deadline_s:.0f}s ({DEADLINE_FACTOR:.0f} x "
                f"spec.reward.model.timeoutSeconds):\n{why}"
            )
        scores: list[float] = []
        errors: list[str | None] = []
        for i in range(len(batches)):
            scores += answers[i].scores
            errors += answers[i].errors
        return scores, errors

    async def _post(
        self, session: aiohttp.ClientSession, ep: str, batch: list[ScoreItem], deadline: float
    ) -> ScoreResponse:
        """One batch on one replica: the answer, `Retry`, or `RewardModelMisconfigured`."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise Retry("no time left")
        timeout = min(self.config.timeout_s, left)
        body = ScoreRequest(request_id=uuid.uuid4().hex[:12], items=batch).model_dump_json()
        headers = {AUTH_HEADER: f"Bearer {self.config.token}", "Content-Type": "application/json"}
        try:
            async with session.post(
                f"{ep}/score", data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                status, raw = resp.status, await resp.read()
        except TimeoutError:
            raise Retry(f"no answer within {timeout:.1f}s (spec.reward.model.timeoutSeconds)") from None
        except aiohttp.ClientError as e:
            raise Retry(f"{type(e).__name__}: {e}") from None
        if status == 200:
            try:
                answer = ScoreResponse.model_validate_json(raw)
            except ValidationError as e:
                raise Retry(f"malformed answer: {e}") from None
            if len(answer.scores) != len(batch) or len(answer.errors) != len(batch):
                raise Retry(f"answered {len(answer.scores)} scores for {len(batch)} completions")
            return answer
        try:
            err = ErrorResponse.model_validate_json(raw)
            code, message = err.code, err.message
        except ValidationError:
            code, message = "", raw[:300].decode(errors="replace")
        if status in RETRIABLE:
            raise Retry(f"HTTP {status} {code}: {message}")
        if code == REWARD_MISCONFIGURED:
            raise RewardModelMisconfigured(f"reward model server {ep}: {message}")
        raise RewardModelMisconfigured(
            f"reward model server {ep} refused /score (HTTP {status} {code}): {message}"
        )
