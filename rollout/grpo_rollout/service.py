"""What a rollout server does, apart from HTTP: generate and score, stage and swap weights, drain.

`grpo_rollout.server` wraps a `RolloutService` in aiohttp handlers. The engine runs on one worker
thread (generations and weight swaps are serialized there, so every response is sampled with exactly
one weight version) and rewards on another (scoring one request overlaps generating the next). An
engine that batches concurrent requests itself (vLLM, `concurrent_generates` > 1) gets that many
generate threads instead; a `Gate` then lets generations overlap and keeps weight swaps alone.
Weight versions (over HTTP, or streamed over the trainer's collective groups) are the
`WeightReceiver`'s (`grpo_rollout.receiver`): the service checks the server can take one and
lends it the engine thread with no generation beside it (`_alone`).
Draining (SIGTERM, e.g. a Spot interruption): new work is refused, work that has not started is
handed back at once, running work gets until the drain deadline and is then handed back unfinished.
A dead engine (`EngineDead` from a call, or its `failure()` seen by `watch`) is final for this
process: the first error is kept, every request is answered `engine_dead`, health says `failed`,
and `grpo_rollout.server` exits non-zero so a new process (a restarted pod) takes over.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from grpo_operator.api.spec import RewardSpec
from grpo_wire.chat import ChatError, ChatSettings, PromptRenderer
from grpo_wire.protocol import (
    ENGINE_DEAD,
    Completion,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    PromptResult,
    RewardDetail,
    ServerState,
    WeightBucket,
    WeightStreamRequest,
    WeightUpdateResponse,
)

from grpo_rollout import episodes
from grpo_rollout.engines.base import (
    Engine,
    EngineConfig,
    EngineDead,
    PromptSamples,
    create_engine,
    engine_failure,
)
from grpo_rollout.environments import EnvironmentRunner
from grpo_rollout.errors import ServiceError, loading
from grpo_rollout.gate import Gate
from grpo_rollout.metrics import RolloutMetrics
from grpo_rollout.receiver import WeightReceiver
from grpo_rollout.rewards.model_client import ModelClientConfig, RewardModelClient
from grpo_rollout.rewards.scorer import RewardScorer
from grpo_rollout.tools.parsers import get_parser
from grpo_rollout.tools.runner import ToolRunner

log = logging.getLogger(__name__)

T = TypeVar("T")
WATCH_S = 1.0  # how often an idle server asks its engine whether it is still alive


@dataclass(frozen=True)
class ToolSettings:
    """spec.tools and the rollout's bounds on episodes; each call gets the reward timeout."""

    paths: tuple[str, ...]  # built-in names or 'module:function'
    parser: str = "hermes"
    max_result_chars: int = 4096
    timeout_s: float = 10.0
    workers: int = 2  # sandbox processes calling tools for concurrent episodes


@dataclass(frozen=True)
class EnvironmentSettings:
    """spec.environment; each reset and step gets the reward timeout."""

    path: str  # 'module:Class'
    args: dict[str, Any] = field(default_factory=dict)
    reward_weight: float = 1.0
    timeout_s: float = 10.0
    max_message_chars: int = 4096
    workers: int = 2


@dataclass(frozen=True)
class ServiceConfig:
    server_id: str
    engine: str
    engine_config: EngineConfig
    reward: RewardSpec
    reward_endpoints: tuple[str, ...] = ()  # contract.reward.endpoints: spec.reward.model's servers
    reward_token: str = ""  # the job's token, which the reward servers check too
    drain_seconds: float = 25.0  # under Kubernetes' default 30 s grace period
    chat: ChatSettings = field(default_factory=ChatSettings)  # how prompts meet the model's chat template
    tools: ToolSettings | None = None  # spec.tools: multi-turn episodes (`grpo_rollout.episodes`)
    environment: EnvironmentSettings | None = None  # spec.environment: interactive episodes
    max_turns: int = 8  # spec.rollout.maxTurns, with tools or an environment


class RolloutService:
    def __init__(self, config: ServiceConfig, metrics: RolloutMetrics | None = None):
        self.config = config
        self.metrics = metrics or RolloutMetrics()
        self.engine: Engine | None = None
        self.scorer: RewardScorer | None = None
        self.renderer: PromptRenderer | None = None
        self.tool_loop: episodes.ToolLoop | None = None
        self.weights = WeightReceiver(config.server_id, self.metrics, self._alone)
        self.draining = False
        self.hand_back = False  # set at the drain deadline: running generations stop and return their prompts
        self.in_flight = 0
        self._engine_pool = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._reward_pool = ThreadPoolExecutor(1, thread_name_prefix="rewards")
        self._generate_pool = self._engine_pool  # widened in start() for an engine that batches
        self._gate = Gate()  # many generations or one weight swap
        self.failure: str | None = None  # the engine's first error once it died: final
        self._dead = asyncio.Event()
        self._warned_timeout = False  # the first judgement that ran out of time is warned about, once

    @property
    def state(self) -> ServerState:
        if self.failure is not None:
            return "failed"
        return "draining" if self.draining else ("ready" if self.engine is not None else "loading")

    async def start(self) -> None:
        """Load the engine and check reward plugins; failures propagate and stop the server."""
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        self.scorer = await loop.run_in_executor(
            self._reward_pool, RewardScorer, self.config.reward, None, self._reward_model()
        )
        tools = self.config.tools
        runner = None
        if tools is not None:  # tools are loaded and described in the sandbox, never in this process
            runner = await loop.run_in_executor(
                self._reward_pool,
                lambda: ToolRunner(
                    tools.paths,
                    timeout=tools.timeout_s,
                    max_result_chars=tools.max_result_chars,
                    workers=tools.workers,
                ),
            )
        self.renderer = await loop.run_in_executor(
            self._reward_pool,
            PromptRenderer.load,
            self.config.engine_config.model_path,
            self.config.chat,
            runner.schemas if runner is not None else None,
        )
        env = self.config.environment
        environment = None
        if env is not None:  # the class is imported and checked in the sandbox workers
            environment = await loop.run_in_executor(
                self._reward_pool,
                lambda: EnvironmentRunner(
                    env.path,
                    env.args,
                    timeout=env.timeout_s,
                    max_message_chars=env.max_message_chars,
                    workers=env.workers,
                ),
            )
        if runner is not None or environment is not None:
            parser = get_parser(tools.parser if tools is not None else "hermes")
            self.tool_loop = episodes.ToolLoop(
                self.renderer, parser, runner, self.config.max_turns, environment, workers=4
            )
        engine = await loop.run_in_executor(
            self._engine_pool, create_engine, self.config.engine, self.config.engine_config
        )
        concurrent = int(getattr(engine, "concurrent_generates", 1))
        if concurrent > 1:
            self._generate_pool = ThreadPoolExecutor(concurrent, thread_name_prefix="generate")
        self.engine = engine
        self.metrics.weight_version.set(self.weights.live_version)
        log.info("%s ready: engine %s in %.1fs", self.config.server_id, engine.name, time.monotonic() - t0)

    def _reward_model(self) -> RewardModelClient | None:
        """The client of spec.reward.model's servers; None without a reward model."""
        model = self.config.reward.model
        if model is None:
            return None
        return RewardModelClient(
            ModelClientConfig(
                self.config.reward_endpoints,
                self.config.reward_token,
                batch_size=model.batch_size,
                timeout_s=model.timeout_seconds,
            )
        )

    def health(self) -> HealthResponse:
        return HealthResponse(
            server_id=self.config.server_id,
            state=self.state,
            weight_version=self.weights.live_version,
            engine=self.config.engine,
            model=self.config.engine_config.model_path,
            in_flight=self.in_flight,
            stream_members=self.weights.members(self.engine),
            stream_holdings=self.weights.holdings(self.engine),
            error=self.failure,
        )

    def died(self, message: str) -> ServiceError:
        """Record the engine's death (the first error wins: later ones are its echoes) and the
        answer every request gets from now on."""
        if self.failure is None:
            self.failure = message or "the engine died without a message"
            log.error("%s: engine dead: %s", self.config.server_id, self.failure)
            self._dead.set()
        return ServiceError(500, ENGINE_DEAD, f"engine dead (permanent for this server): {self.failure}")

    @contextlib.contextmanager
    def _engine_call(self) -> Iterator[None]:
        """Around an awaited engine call: `EngineDead` becomes the permanent `engine_dead` answer."""
        try:
            yield
        except EngineDead as e:
            raise self.died(str(e)) from None

    async def watch(self) -> str:
        """Return the engine's first error once it is dead, whether a request found out (`died`)
        or the engine says so itself while idle (`failure()`: vLLM watches its engine core)."""
        while self.failure is None:
            if self.engine is not None and (failure := engine_failure(self.engine)):
                self.died(failure)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dead.wait(), WATCH_S)
        return self.failure

    def refuse_if_not_ready(self) -> None:
        if self.failure is not None:
            raise self.died(self.failure)
        if self.draining:
            raise ServiceError(
                503, "draining", "server is draining (shutting down); send elsewhere", retry_after=5
            )
        if self.engine is None:
            raise loading()

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        self.refuse_if_not_ready()
        if self.weights.torn:
            why = f": {self.weights.torn_why}" if self.weights.torn_why else ""
            raise ServiceError(
                503, "loading", f"weights incomplete (a stream broke{why}); waiting for the next version"
            )
        live = self.weights.live_version
        if req.min_weight_version is not None and live < req.min_weight_version:
            raise ServiceError(
                409,
                "weight_too_old",
                f"server has weight version {live}, request needs >= {req.min_weight_version}",
            )
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        self.metrics.in_flight.inc()
        t0 = time.monotonic()
        try:
            with self._engine_call():
                async with self._gate.shared():
                    version, samples = await loop.run_in_executor(
                        self._generate_pool, self._generate_now, req
                    )
            t1 = time.monotonic()
            results = await loop.run_in_executor(self._reward_pool, self._score, req, samples, version)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
        unfinished = [p.id for p, s in zip(req.prompts, samples, strict=True) if s is None]
        self.metrics.latency.observe(time.monotonic() - t0)
        self.metrics.handed_back.inc(len(unfinished))
        return GenerateResponse(
            request_id=req.request_id,
            server_id=self.config.server_id,
            weight_version=version,
            results=results,
            unfinished_prompt_ids=unfinished,
            generation_seconds=t1 - t0,
            reward_seconds=time.monotonic() - t1,
        )

    def _generate_now(self, req: GenerateRequest) -> tuple[int, list[PromptSamples | None]]:
        """On the engine thread; work that only starts once draining began is handed back whole."""
        assert self.engine is not None and self.renderer is not None
        version = self.weights.live_version  # weight swaps run on this same thread: stable until we return
        if self.draining:
            return version, [None] * len(req.prompts)
        try:
            rendered = [self.renderer.render(p).token_ids for p in req.prompts]
        except ChatError as e:
            raise ServiceError(422, "bad_prompt", str(e)) from None
        try:
            if self.tool_loop is not None:
                out = episodes.run(
                    self.engine,
                    req.prompts,
                    rendered,
                    req.n,
                    req.sampling,
                    lambda: self.hand_back,
                    self.tool_loop,
                    routing=req.return_routing,
                    request_id=req.request_id,
                )
            else:
                out = self.engine.generate(
                    rendered, req.n, req.sampling, lambda: self.hand_back, routing=req.return_routing
                )
        except ValueError as e:
            raise ServiceError(422, "bad_request", str(e)) from None
        return version, out

    def _count_timeout(self, detail: RewardDetail) -> None:
        """A judgement that ran out of its time: counted, and warned about the first time."""
        self.metrics.reward_timeouts.labels(detail.name).inc()
        if not self._warned_timeout:
            self._warned_timeout = True
            log.warning(
                "reward %s ran out of time judging a sample (%s): its score counted as 0, no verdict; "
                "reported as reward_timeouts (this warning is not repeated)",
                detail.name,
                detail.error,
            )

    def _score(
        self, req: GenerateRequest, samples: list[PromptSamples | None], version: int
    ) -> list[PromptResult]:
        """On the reward thread: flatten finished prompts' completions, score them, rebuild per prompt."""
        assert self.scorer is not None
        done = [(p, s) for p, s in zip(req.prompts, samples, strict=True) if s is not None]
        prompts, completions, rows = [], [], []
        for prompt, ps in done:
            for sample in ps.samples:
                prompts.append(prompt.raw)
                completions.append(sample.text)
                rows.append(prompt.columns)
        names = sorted({k for row in rows for k in row} - {"prompts", "completions"})
        columns: dict[str, list[Any]] = {k: [row.get(k) for row in rows] for k in names}
        scored = self.scorer.score(prompts, completions, columns) if completions else []
        results, k = [], 0
        for prompt, ps in done:
            completions_out = []
            for sample in ps.samples:
                reward, details = scored[k]
                k += 1
                env = self.config.environment
                if env is not None and (sample.env_reward is not None or sample.env_error is not None):
                    score = sample.env_reward or 0.0
                    reward += env.reward_weight * score
                    details = [*details, RewardDetail(
                        name="environment", weight=env.reward_weight, score=score, error=sample.env_error
                    )]  # fmt: skip
                for d in details:
                    if d.error is not None:
                        self.metrics.reward_failures.labels(d.name).inc()
                    if d.timed_out:
                        self._count_timeout(d)
                completions_out.append(
                    Completion(
                        text=sample.text,
                        token_ids=sample.token_ids,
                        logprobs=sample.logprobs,
                        finish_reason=sample.finish_reason,
                        reward=reward,
                        reward_details=details,
                        routing=sample.routing,
                        mask=sample.mask,
                        turns=sample.turns,
                        tool_calls=sample.tool_calls,
                        tool_errors=sample.tool_errors,
                    )
                )
                self.metrics.tokens.inc(len(sample.token_ids))
            self.metrics.sequences.inc(len(ps.samples))
            self.metrics.prompt_tokens.inc(len(ps.prompt_token_ids))
            results.append(
                PromptResult(
                    prompt_id=prompt.id,
                    prompt_token_ids=ps.prompt_token_ids,
                    completions=completions_out,
                    weight_version=version,
                )
            )
        return results

    async def _alone(self, fn: Callable[[], T]) -> T:
        """`fn` on the engine thread with no generation beside it (weight swaps); an engine that
        dies in it makes the server's permanent `engine_dead` answer."""
        loop = asyncio.get_running_loop()
        with self._engine_call():
            async with self._gate.exclusive():
                return await loop.run_in_executor(self._engine_pool, fn)

    async def add_weights(self, meta: WeightBucket, data: bytes) -> WeightUpdateResponse:
        self.refuse_if_not_ready()
        assert self.engine is not None
        return await self.weights.push(self.engine, meta, data)

    async def stream_weights(self, req: WeightStreamRequest) -> WeightUpdateResponse:
        """A streamed version; a draining server takes it too (its groups are waiting on it), only
        a loading one refuses."""
        if self.failure is not None:
            raise self.died(self.failure)
        if self.engine is None:
            raise loading()
        return await self.weights.stream(self.engine, req)

    async def drain(self) -> None:
        """Refuse new work, give running work until the deadline, then hand back what is left; a
        weight stream being received is finished first (within the deadline)."""
        self.draining = True
        self.metrics.draining.set(1)
        deadline = time.monotonic() + self.config.drain_seconds
        log.info(
            "draining: %d request(s) in flight, %.0fs to finish them",
            self.in_flight,
            self.config.drain_seconds,
        )
        while self.in_flight and time.monotonic() < deadline - 2.0:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("drain deadline near: handing back the prompts of %d request(s)", self.in_flight)
            self.hand_back = True
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        while self.weights.receiving and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # leaving mid-stream would break it for every other server

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        if self.tool_loop is not None:
            for part in (self.tool_loop.runner, self.tool_loop.environment):
                if part is not None:
                    part.close()
        self._engine_pool.shutdown(wait=False, cancel_futures=True)
        self._generate_pool.shutdown(wait=False, cancel_futures=True)
        self._reward_pool.shutdown(wait=False, cancel_futures=True)
