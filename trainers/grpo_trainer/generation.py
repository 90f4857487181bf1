"""Trainer rank 0's side of the rollout servers: asynchronous generation and versioned weight pushes.

Called by the training loop on rank 0 only. `grpo_wire.client.RolloutClient` (asyncio) runs
on a private event-loop thread, so the loop can `submit` the next step's prompts and keep
training while the servers generate (the overlap `maxStaleness` allows), then `push` new
weights after the optimizer step. Before every generation request the servers' health is read
and any server behind the trainer's weight version (a restarted or replaced pod starts from
the model on disk) is sent the latest version again, so a lost server heals within one step.
The server set is followed during the run (`grpo_trainer.membership`: EndpointSlices in a cluster,
else the run contract file): a server that leaves gets no more work (its unanswered prompts are
re-sent elsewhere); one that joins is first brought to the live weight version over HTTP and only
then given prompts. A server whose engine died is never sent work again (it exits and its pod
restarts, `grpo_wire.client`); when every server is dead, generation waits, bounded, for a
replacement to report ready instead of retrying the dead ones. Every wait is bounded; failures
name the server.

Weights go out over one of two transports (spec.rollout.weightSync, chosen by
`grpo_trainer.pusher`): `push` sends HTTP buckets built on rank 0 (kept for servers that join
later); `stream` tells the servers to receive a version over the trainer ranks' collective groups
(`grpo_trainer.weight_sync`), the trainer ranks sending meanwhile. Under `stream` nothing is kept
on rank 0: a server that joins is put in the group of the next version (`stream_plan` forms the
groups again) and given work once it runs it; one that comes up behind the live version while
generation waits (`behind`) is streamed that version at once, by every rank (`WeightPusher.catch_up`).
A version that finds no server ready is not lost: it goes to the replacements as they come.
"""

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import torch
from grpo_operator.api.algorithm import AlgorithmSpec
from grpo_operator.api.contract import RunContract
from grpo_operator.api.status import Reason
from grpo_wire.client import (
    GenerateError,
    RolloutClient,
    RolloutError,
    ServerError,
    WeightPushResult,
    WeightSyncError,
    bucketize,
)
from grpo_wire.protocol import (
    REWARD_MISCONFIGURED,
    REWARD_UNAVAILABLE,
    HealthResponse,
    Prompt,
    PromptResult,
    Sampling,
    WeightStreamRequest,
)

from grpo_trainer import membership
from grpo_trainer.batch import Rollouts
from grpo_trainer.config import ConfigError
from grpo_trainer.data import Row

log = logging.getLogger(__name__)
T = TypeVar("T")

GENERATE_DEADLINE_S = 900.0  # give up on a step's generation (servers all gone) after this long
RETRY_PAUSE_S = 2.0
PUSH_DEADLINE_S = 600.0
CATCH_UP_TRIES = 5  # catch-up rounds per poll for a joining server overtaken by new versions
# A reward model that scored nothing for this many spec.reward.model.timeoutSeconds fails the job
# (RewardModelUnavailable): long enough for a lost reward pod to be replaced and load its model.
REWARD_DOWN_FACTOR = 10.0


def member_ranks(members_per_server: list[int]) -> tuple[list[int], int]:
    """Each server's first member rank among all receiving members (servers in plan order, each
    taking its `stream_members` consecutive ranks), and the total."""
    first, total = [], 0
    for k in members_per_server:
        first.append(total)
        total += k
    return first, total


def member_classes(
    servers: list[tuple[int, list[list[int] | None] | None]],
) -> tuple[list[int], list[list[int] | None]]:
    """From each server's (members, per-member experts held or None), every member's holding class
    and each class's experts, classes in order of first appearance; ([], []) when every member holds
    the whole model (the stream then needs no classes)."""
    classes: list[int] = []
    distinct: list[tuple[int, ...] | None] = []
    for members, held in servers:
        for i in range(members):
            h = None if held is None or held[i] is None else tuple(sorted(held[i]))
            if h not in distinct:
                distinct.append(h)
            classes.append(distinct.index(h))
    if distinct == [None]:
        return [], []
    return classes, [None if d is None else list(d) for d in distinct]


class Generator:
    """Rank 0's handle on every rollout server of the job."""

    def __init__(
        self,
        endpoints: list[str],
        token: str,
        algo: AlgorithmSpec,
        *,
        request_timeout_s: float = 600.0,
        source: membership.Source | None = None,
        poll_s: float = membership.POLL_S,
        streams: bool = False,
        reward_down_s: float | None = None,
    ):
        """`source`: where the live server set is read every `poll_s` seconds (None: `endpoints`
        stay fixed); `streams`: weights go over the collective transport (nothing kept here);
        `reward_down_s`: how long the job's reward model may answer no server before the job fails
        (None: the job has none)."""
        self._algo = algo
        self._reward_down_s = reward_down_s
        self._token = token
        self.streams = streams
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self._client = RolloutClient(endpoints, token, request_timeout_s=request_timeout_s)
        self._latest: tuple[list[bytes], int] | None = None  # last pushed (buckets, version), for laggards
        self._repair_task: asyncio.Task | None = None
        self._push_lock = asyncio.Lock()
        self.version = 0
        self._wanted: list[str] = list(endpoints)  # the servers membership says exist
        # (epoch, [(server, its stream members)]) of the weight groups
        self._group: tuple[int, list[tuple[str, int, Any]]] | None = None
        self._follow_task: concurrent.futures.Future | None = None
        if source is not None:
            follower = membership.Follower(source, list(endpoints))
            self._follow_task = self._run(self._follow(follower, poll_s))

    @classmethod
    def for_contract(cls, contract: RunContract, token: str, *, streams: bool) -> "Generator":
        """The job's servers, followed live through the best membership source available, each
        /generate answer awaited as long as the job's decode may take (rollout.generateTimeoutSeconds)."""
        source = membership.choose_source(contract)
        algo = contract.spec.algorithm
        timeout = contract.spec.rollout.generate_timeout_s(algo)
        endpoints = contract.rollout.endpoints
        model = contract.spec.reward.model
        reward_down_s = REWARD_DOWN_FACTOR * model.timeout_seconds if model is not None else None
        return cls(
            endpoints,
            token,
            algo,
            request_timeout_s=timeout,
            source=source,
            streams=streams,
            reward_down_s=reward_down_s,
        )

    @property
    def members(self) -> list[str]:
        """The servers given work now (joined and caught up, not left)."""
        return list(self._client.endpoints)

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
        prompts = [Prompt.of(str(pos), row.prompt, row.columns) for pos, row in rows]
        return self._run(self._generate(prompts, sampling, self.version, max(0, min_version)))

    async def _generate(
        self, prompts: list[Prompt], sampling: Sampling, version: int, min_version: int
    ) -> Rollouts:
        algo = self._algo
        results = await self._results(prompts, algo.group_size, sampling, min_version, algo.routing_replay)
        return Rollouts.from_results(
            results, algo.group_size, weight_version=version, routing=algo.routing_replay
        )

    def rewards(
        self, prompts: list[Prompt], n: int, sampling: Sampling, *, min_version: int
    ) -> list[list[float]]:
        """The rewards of n completions per prompt, in prompt order, sampled with weights of at least
        `min_version` (what held-out evaluation scores). Blocks, bounded like a step's generation."""
        results = self._run(self._results(prompts, n, sampling, min_version, routing=False)).result()
        return [[c.reward for c in r.completions] for r in results]

    async def _results(
        self, prompts: list[Prompt], n: int, sampling: Sampling, min_version: int, routing: bool
    ) -> list[PromptResult]:
        """n completions per prompt from the servers; a round that failed for a transient reason
        (draining, restarting, overloaded) is retried until the deadline; one that found every
        engine dead waits for a replacement, never retrying the dead. Rounds that failed only because
        the reward model answered no server are retried for `reward_down_s` instead, then the job
        fails with RewardModelUnavailable (no gang restart brings a reward model back)."""
        deadline = time.monotonic() + GENERATE_DEADLINE_S
        reward_down_since: float | None = None
        while True:
            self._start_repair()
            started = time.monotonic()
            try:
                return await self._client.generate(
                    prompts, n=n, sampling=sampling, min_weight_version=min_version, routing=routing
                )
            except ServerError as e:
                # spec.reward.model cannot score as written: no restart helps
                if e.code == REWARD_MISCONFIGURED:
                    raise ConfigError(str(e), reason=Reason.REWARD_MODEL_MISCONFIGURED) from None
                raise
            except GenerateError as e:
                if self._reward_down_s is not None and e.only(REWARD_UNAVAILABLE):
                    reward_down_since = reward_down_since or started
                    self._reward_down(e, time.monotonic() - reward_down_since)
                    deadline = time.monotonic() + GENERATE_DEADLINE_S  # the reward budget bounds this
                    await asyncio.sleep(RETRY_PAUSE_S)
                    continue
                reward_down_since = None
                if time.monotonic() > deadline:
                    raise
                if e.all_dead:
                    await self._await_replacement(e, deadline)
                    continue
                log.warning("generation failed, retrying in %.0fs: %s", RETRY_PAUSE_S, e)
                await asyncio.sleep(RETRY_PAUSE_S)

    def _reward_down(self, e: GenerateError, down_s: float) -> None:
        """Log a round the reward model failed; past the budget, fail the job naming it."""
        budget = self._reward_down_s or 0.0
        if down_s < budget:
            log.warning(
                "the reward model servers answered no rollout server for %.0fs (the job fails at %.0fs, "
                "%.0f x spec.reward.model.timeoutSeconds); retrying:\n%s",
                down_s,
                budget,
                REWARD_DOWN_FACTOR,
                "\n".join(f"  {why}" for why in e.failures.values()),
            )
            return
        why = "\n".join(f"  {why}" for why in e.failures.values())
        raise ConfigError(
            f"the reward model servers (spec.reward.model, <job>-reward pods) scored nothing for "
            f"{down_s:.0f}s ({REWARD_DOWN_FACTOR:.0f} x spec.reward.model.timeoutSeconds = {budget:.0f}s); "
            f"check the reward pods' logs and readiness (status.reward). Last errors:\n{why}",
            reason=Reason.REWARD_MODEL_UNAVAILABLE,
        )

    async def _await_replacement(self, dead: GenerateError, deadline: float) -> None:
        """Every server's engine died (permanent for those processes): poll health until a new
        process reports ready (which lifts its dead mark), failing with the engines' own errors
        when none does by `deadline` (its pod does not come back)."""
        log.warning(
            "every rollout server's engine is dead; waiting up to %.0fs for a restarted server "
            "(no work goes to a dead one):\n%s",
            max(0.0, deadline - time.monotonic()),
            "\n".join(f"  {why}" for why in dead.dead.values()),
        )
        while self._client.all_dead:
            if time.monotonic() > deadline:
                raise RolloutError(f"no rollout server replaced the dead ones in time: {dead}")
            await asyncio.sleep(RETRY_PAUSE_S)
            await self._client.health()
        log.info("a rollout server is ready again: generation resumes")

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

    async def _follow(self, follower: membership.Follower, poll_s: float) -> None:
        """Every `poll_s`: drop servers that left the set; admit joining ones once caught up."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(poll_s)
            try:
                wanted = await loop.run_in_executor(None, follower.poll)
                await self._update_members(wanted)
            except Exception:  # never let membership stop generation: the last set stays
                log.exception("updating the rollout server set failed; keeping the current one")

    async def _update_members(self, wanted: list[str]) -> None:
        wanted = [e.rstrip("/") for e in wanted]
        self._wanted = wanted
        current = self._client.endpoints
        gone = [e for e in current if e not in wanted]
        if gone:
            log.info("rollout servers left: %s", ", ".join(gone))
            self._client.set_endpoints([e for e in current if e in wanted])
        joining = [e for e in wanted if e not in self._client.endpoints]
        await asyncio.gather(*(self._admit(e) for e in joining))

    async def _admit(self, ep: str) -> bool:
        """Give `ep` work once it is ready at the live weight version. The check and the admission
        hold the push lock, so no version can go out between them: an admitted server gets every
        later push. A server still loading, or overtaken by a push, is tried again next poll."""
        for _ in range(CATCH_UP_TRIES):
            async with RolloutClient([ep], self._token) as one:
                if not await self._catch_up(one, ep):
                    return False
                async with self._push_lock:
                    health = (await one.health())[ep]
                    if not isinstance(health, HealthResponse) or health.state != "ready":
                        return False
                    if health.weight_version >= self.version:
                        self._client.set_endpoints([*self._client.endpoints, ep])
                        log.info(
                            "rollout server %s joined at weight version %d; sending it work",
                            ep,
                            health.weight_version,
                        )
                        return True
        return False

    async def _catch_up(self, one: RolloutClient, ep: str) -> bool:
        """Send the latest pushed version to `ep` (alone, over HTTP) if it runs an older one; False
        when it is not ready or did not take it."""
        health = (await one.health())[ep]
        if not isinstance(health, HealthResponse) or health.state != "ready":
            return False
        latest = self._latest
        if latest is None or health.weight_version >= latest[1]:
            return True
        log.info(
            "rollout server %s is at weight version %d: sending it version %d before any work",
            ep,
            health.weight_version,
            latest[1],
        )
        try:
            await one.push_weights(*latest)
        except Exception as e:
            log.warning("rollout server %s joined but could not take the live weights: %s", ep, e)
            return False
        return True

    def push(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightPushResult:
        """Send weight `version` to every server; blocks until done (bounded); raises WeightSyncError
        when a server that is ready refused it and none took it (with none ready, it is kept for the
        replacements: `_repair`)."""
        buckets = bucketize(state_dict)
        return self._run(self._push(buckets, version)).result(timeout=PUSH_DEADLINE_S)

    async def _push(self, buckets: list[bytes], version: int) -> WeightPushResult:
        async with self._push_lock:  # a joining server is admitted between pushes, never during one
            try:
                result = await self._client.push_weights(buckets, version)
            except WeightSyncError as e:
                if await self._ready():
                    raise  # a server that is up refused it: a fault of the version, not of a server
                log.warning("weights v%d: no rollout server is ready to take it; it goes to each "
                            "replacement as it comes up:\n%s", version, e)  # fmt: skip
                result = WeightPushResult(version=version, failed=e.failures)
            self._latest, self.version = (buckets, version), version
        return result

    async def _ready(self, among: list[str] | None = None) -> dict[str, HealthResponse]:
        """The health of the servers (members and joiners, or `among`) that are ready now."""
        candidates = among if among is not None else [*self._client.endpoints, *self._wanted]
        candidates = list(dict.fromkeys(candidates))
        async with RolloutClient(candidates, self._token) as probe:
            health = await probe.health()
        return {
            ep: h for ep in candidates if isinstance(h := health[ep], HealthResponse) and h.state == "ready"
        }

    def sent_to_none(self, version: int) -> None:
        """No server was ready to take streamed `version`: it is the live one all the same, and a
        server that comes up behind it is caught up (`behind`)."""
        log.warning("weights v%d: no rollout server is ready to take it; each replacement is "
                    "streamed it as it comes up", version)  # fmt: skip
        self.version = version

    def behind(self) -> list[str]:
        """Under the collective transport: ready servers that run an older version than the live
        one (a replaced server starts from the model on disk), which only a stream can bring up
        to date; `WeightPusher.catch_up` streams it to them. (Over HTTP the repair before each
        generation round sends the kept copy: none here.)"""
        if not self.streams or self.version == 0:
            return []
        ready = self._run(self._ready()).result(timeout=60)
        return [ep for ep, h in ready.items() if h.weight_version < self.version]

    def stream_plan(self, only: list[str] | None = None) -> dict:
        """The servers the next streamed version goes to (members and ready joiners, or those of
        `only` that are ready), the epoch of their groups (a new one whenever that set, or what the
        servers contribute, changed, or the last stream failed), and the receiving members of each
        group: every server takes `stream_members` ranks (its process, or each of its engine's
        workers), the first at `first[i]`, `members` in all."""
        return self._run(self._stream_plan(only)).result(timeout=120)

    async def _stream_plan(self, only: list[str] | None) -> dict:
        ready = await self._ready(only)
        servers = list(ready)
        shape = [(ep, ready[ep].stream_members, ready[ep].stream_holdings) for ep in servers]
        if self._group is None or self._group[1] != shape:
            before = [ep for ep, *_ in self._group[1]] if self._group is not None else []
            self._group = (random.getrandbits(48), shape)
            for ep in (e for e in servers if e not in before):
                log.info("rollout server %s joins the weight groups: the next version reaches it there", ep)
        first, total = member_ranks([k for _, k, _ in shape])
        classes, holdings = member_classes([(k, held) for _, k, held in shape])
        return {
            "epoch": self._group[0],
            "servers": servers,
            "first": first,
            "members": total,
            "classes": classes,  # every member's holding class (empty: all hold the whole model)
            "holdings": holdings,
        }

    def stream(
        self, plan: dict, version: int, request: dict, on_failure: Callable[[str, Exception], None]
    ) -> "concurrent.futures.Future[WeightPushResult]":
        """Tell every server of `plan` to receive `version` over the groups (`request`: the
        WeightStreamRequest fields shared by all); the caller sends meanwhile, then waits on the
        Future. `on_failure(server, error)` hears at once of a server that failed (the caller calls
        the stream off). Raises WeightSyncError (from the Future) when no server took it."""
        requests = {
            ep: WeightStreamRequest(
                version=version,
                epoch=plan["epoch"],
                members=plan["members"],
                first_member=plan["first"][i],
                **request,
            )
            for i, ep in enumerate(plan["servers"])
        }
        return self._run(self._stream(requests, version, on_failure))

    async def _stream(
        self,
        requests: dict[str, WeightStreamRequest],
        version: int,
        on_failure: Callable[[str, Exception], None],
    ) -> WeightPushResult:
        async with self._push_lock:  # a joining server is admitted between pushes, never during one
            result = await self._client.stream_weights(requests, on_failure)
            if result.failed:
                self._group = None  # the groups of a failed stream are formed again
            if not result.live:
                raise WeightSyncError(version, result.failed or {"-": "no rollout server in the group"})
            self.version = version
            self._latest = None  # nothing kept: a joiner gets the next version through the groups
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
        if self._follow_task is not None:
            self._follow_task.cancel()
        self._run(self._client.close()).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
