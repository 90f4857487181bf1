"""Trainer rank 0's side of the rollout servers: asynchronous generation and versioned weight pushes.

Called by the training loop on rank 0 only. `grpo_rollout.client.RolloutClient` (asyncio) runs
on a private event-loop thread, so the loop can `submit` the next step's prompts and keep
training while the servers generate (the overlap `maxStaleness` allows), then `push` new
weights after the optimizer step. Before every generation request the servers' health is read
and any server behind the trainer's weight version (a restarted or replaced pod starts from
the model on disk) is sent the latest version again, so a lost server heals within one step.
Every wait is bounded; failures name the server.
"""

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import torch
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_rollout.client import GenerateError, RolloutClient, RolloutError, WeightPushResult, bucketize
from grpo_rollout.protocol import HealthResponse, Prompt, Sampling

from grpo_trainer.batch import Rollouts
from grpo_trainer.data import Row

log = logging.getLogger(__name__)
T = TypeVar("T")

GENERATE_DEADLINE_S = 900.0  # give up on a step's generation (servers all gone) after this long
RETRY_PAUSE_S = 2.0
PUSH_DEADLINE_S = 600.0


class Generator:
    """Rank 0's handle on every rollout server of the job."""

    def __init__(
        self, endpoints: list[str], token: str, algo: AlgorithmSpec, *, request_timeout_s: float = 600.0
    ):
        self._algo = algo
        self._token = token
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self._client = RolloutClient(endpoints, token, request_timeout_s=request_timeout_s)
        self._latest: tuple[list[bytes], int] | None = None  # last pushed (buckets, version), for laggards
        self._repair_task: asyncio.Task | None = None
        self.version = 0

    def _run(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def submit(
        self, rows: list[tuple[int, Row]], *, step: int, min_version: int
    ) -> "concurrent.futures.Future[Rollouts]":
        """Start generating `rows` (position, row) with the servers' current weights; returns a Future.

        The sampling seed is a function of the job seed and the step, so a resumed run samples
        the same way; servers older than `min_version` refuse (the staleness bound).
        """
        algo = self._algo
        sampling = Sampling(
            temperature=algo.temperature,
            top_p=algo.top_p,
            max_new_tokens=algo.max_new_tokens,
            seed=algo.seed * 1_000_003 + step,
        )
        prompts = [Prompt(id=str(pos), text=row.prompt, columns=row.columns) for pos, row in rows]
        return self._run(self._generate(prompts, sampling, self.version, max(0, min_version)))

    async def _generate(
        self, prompts: list[Prompt], sampling: Sampling, version: int, min_version: int
    ) -> Rollouts:
        deadline = time.monotonic() + GENERATE_DEADLINE_S
        while True:
            self._start_repair()
            try:
                results = await self._client.generate(
                    prompts,
                    n=self._algo.group_size,
                    sampling=sampling,
                    min_weight_version=min_version,
                    routing=self._algo.routing_replay,
                )
                return Rollouts.from_results(
                    results, self._algo.group_size, weight_version=version, routing=self._algo.routing_replay
                )
            except GenerateError as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("generation failed, retrying in %.0fs: %s", RETRY_PAUSE_S, e)
                await asyncio.sleep(RETRY_PAUSE_S)

    def _start_repair(self) -> None:
        """Check for lagging servers in the background: a slow or dead server's health probe must
        not delay generation on the others (min_weight_version keeps laggards out meanwhile)."""
        if self._latest is not None and (self._repair_task is None or self._repair_task.done()):
            self._repair_task = asyncio.ensure_future(self._repair(*self._latest))

    async def _repair(self, buckets: list[bytes], version: int) -> None:
        """Re-send `version` to ready servers that run an older one (restarted or replaced pods)."""
        health = await self._client.health()
        behind = [
            ep
            for ep, h in health.items()
            if isinstance(h, HealthResponse) and h.state == "ready" and h.weight_version < version
        ]
        if not behind:
            return
        log.warning("rollout servers %s are behind weight version %d; re-sending it", behind, version)
        async with RolloutClient(behind, self._token) as client:
            try:
                await client.push_weights(buckets, version)
            except Exception as e:  # the generate that follows reports what is still wrong
                log.warning("re-sending weights failed: %s", e)

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightPushResult:
        """Send weight `version` to every server; blocks until done (bounded); raises WeightSyncError
        when no server took it."""
        buckets = bucketize(state_dict)
        result = self._run(self._client.push_weights(buckets, version)).result(timeout=PUSH_DEADLINE_S)
        self._latest, self.version = (buckets, version), version
        return result

    def live_versions(self, wait_s: float = GENERATE_DEADLINE_S) -> dict[str, int]:
        """Each ready server's live weight version, waiting (bounded) until at least one is ready:
        trainer pods often start before the rollout pods have loaded their model."""
        deadline = time.monotonic() + wait_s
        while True:
            health = self._run(self._client.health()).result(timeout=60)
            ready = {
                ep: h for ep, h in health.items() if isinstance(h, HealthResponse) and h.state == "ready"
            }
            if ready:
                return {ep: h.weight_version for ep, h in ready.items()}
            if time.monotonic() > deadline:
                why = "; ".join(f"{ep}: {h if isinstance(h, str) else h.state}" for ep, h in health.items())
                raise RolloutError(
                    f"no rollout server became ready in {wait_s:.0f}s: {why or 'none configured'}"
                )
            time.sleep(RETRY_PAUSE_S)

    def close(self) -> None:
        self._run(self._client.close()).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
