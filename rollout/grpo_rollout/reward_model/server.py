"""The reward model server's HTTP shell: POST /score, GET /health, GET /metrics (aiohttp).

`python -m grpo_rollout reward` (see `grpo_rollout.__main__`) calls `serve`. It listens first (health
says loading), loads the job's model (`base.load`), then scores: every request on one model thread,
in order. /score needs the job's bearer token (401), its body is a `ScoreRequest` (422 bad_request,
protocol_mismatch); a model that cannot score as configured answers 422 `reward_misconfigured` with
the message naming the field, which the rollout server passes on (`grpo_rollout.rewards.model_client`).
On SIGTERM it refuses new work (503 draining), lets what runs finish, and returns.
"""

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from grpo_wire.protocol import (
    MAX_GENERATE_BODY_BYTES,
    REWARD_MISCONFIGURED,
    HealthResponse,
    ScoreRequest,
    ScoreResponse,
    ServerState,
)
from prometheus_client import CollectorRegistry, Counter, Histogram

from grpo_rollout.errors import ServiceError, loading
from grpo_rollout.reward_model.base import LoadConfig, Misconfigured, RewardModel, load
from grpo_rollout.server import TOKEN, guard_for, metrics_handler, parse_body, read_bounded

log = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/metrics"}


@dataclass
class RewardMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "grpo_reward_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "code"],
            registry=r,
        )
        self.items = Counter("grpo_reward_items_scored", "Completions scored.", registry=r)
        self.parse_failures = Counter(
            "grpo_reward_parse_failures",
            "Items scored 0 with a reason: judge texts without a score, inputs past maxModelLen.",
            registry=r,
        )
        self.seconds = Histogram(
            "grpo_reward_request_seconds",
            "Wall time of a /score request, queueing included.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=r,
        )


class RewardService:
    """The model and its one thread; what the handlers call."""

    def __init__(self, server_id: str, kind: str, config: LoadConfig, spec: Any):
        self.server_id, self.kind, self.config, self.spec = server_id, kind, config, spec
        self.metrics = RewardMetrics()
        self.model: RewardModel | None = None
        self.draining = False
        self.in_flight = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="reward-model")

    @property
    def state(self) -> ServerState:
        return "draining" if self.draining else ("ready" if self.model is not None else "loading")

    async def start(self) -> None:
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        self.model = await loop.run_in_executor(self._pool, load, self.kind, self.config, self.spec)
        log.info(
            "%s ready: %s %s in %.1fs", self.server_id, self.kind, self.config.path, time.monotonic() - t0
        )

    def health(self) -> HealthResponse:
        return HealthResponse(
            server_id=self.server_id,
            state=self.state,
            weight_version=0,
            engine=self.model.engine if self.model is not None else f"reward-{self.kind}",
            model=self.config.path,
            in_flight=self.in_flight,
        )

    async def score(self, req: ScoreRequest) -> ScoreResponse:
        if self.draining:
            raise ServiceError(503, "draining", "reward server is draining; send elsewhere", retry_after=5)
        if self.model is None:
            raise loading()
        model = self.model
        t0 = time.monotonic()
        self.in_flight += 1
        try:
            scores, errors = await asyncio.get_running_loop().run_in_executor(
                self._pool, model.score, req.items
            )
        except Misconfigured as e:
            log.error("%s: %s", self.server_id, e)
            raise ServiceError(422, REWARD_MISCONFIGURED, str(e)) from None
        finally:
            self.in_flight -= 1
            self.metrics.seconds.observe(time.monotonic() - t0)
        self.metrics.items.inc(len(scores))
        self.metrics.parse_failures.inc(sum(e is not None for e in errors))
        return ScoreResponse(scores=scores, errors=errors, model=self.spec.path)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if (close := getattr(self.model, "close", None)) is not None:
            close()  # the vllm engine's processes end now, not at interpreter exit


SERVICE = web.AppKey("reward_service", RewardService)


guard = guard_for(SERVICE, lambda service: service.server_id)


async def handle_score(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    req = parse_body(await read_bounded(request, MAX_GENERATE_BODY_BYTES), ScoreRequest)
    response = await service.score(req)
    return web.Response(text=response.model_dump_json(), content_type="application/json")


async def handle_health(request: web.Request) -> web.Response:
    health = request.app[SERVICE].health()
    status = 200 if health.state == "ready" else 503
    return web.Response(status=status, text=health.model_dump_json(), content_type="application/json")


def make_app(service: RewardService, token: str) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=MAX_GENERATE_BODY_BYTES)
    app[SERVICE], app[TOKEN] = service, token
    app.router.add_post("/score", handle_score)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", metrics_handler(SERVICE))
    return app


async def serve(service: RewardService, token: str, host: str, port: int, drain_seconds: float) -> None:
    """Listen first (health says loading), load, serve until SIGTERM/SIGINT, drain, return; a model
    that fails to load raises (the process exits non-zero with its message)."""
    runner = web.AppRunner(
        make_app(service, token), handle_signals=False, access_log=None, shutdown_timeout=5.0
    )
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("%s listening on %s:%d", service.server_id, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        loading_task = asyncio.ensure_future(service.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading_task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if loading_task.done():
            loading_task.result()
            await stopped
        else:
            loading_task.cancel()
        service.draining = True
        deadline = time.monotonic() + drain_seconds
        while service.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
        service.close()
        log.info("%s stopped", service.server_id)
