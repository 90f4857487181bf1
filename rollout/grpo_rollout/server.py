"""The rollout server's HTTP shell: aiohttp handlers around a `RolloutService`, auth, size limits, signals.

`python -m grpo_rollout serve` (see `grpo_rollout.__main__`) calls `serve`. Handlers only parse,
check and translate: bodies are read with a hard byte limit (413), payloads validated by the
protocol models (422, protocol_mismatch for another protocol version), /generate and /weights need
the per-job bearer token (401); /health and /metrics are open for probes and scrapers. On SIGTERM
or SIGINT the service drains and the process exits 0. When the engine dies, requests in flight are
answered `engine_dead`, health says `failed` with the engine's first error, and `serve` raises
`EngineDead` after a short grace: the process exits non-zero, so the pod is restarted (a dead
engine never comes back in this process).
"""

import asyncio
import hmac
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from grpo_wire.protocol import (
    AUTH_HEADER,
    MAX_GENERATE_BODY_BYTES,
    MAX_WEIGHT_BUCKET_BYTES,
    PROTOCOL_VERSION,
    ErrorResponse,
    GenerateRequest,
    WeightBucket,
    WeightStreamRequest,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from grpo_rollout.engines.base import EngineDead
from grpo_rollout.errors import ServiceError
from grpo_rollout.service import RolloutService

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", RolloutService)
TOKEN = web.AppKey("token", str)
OPEN_PATHS = {"/health", "/metrics"}
DEAD_GRACE_S = 5.0  # a dead engine's server answers what is in flight (engine_dead), then exits

M = TypeVar("M", bound=BaseModel)


def error(
    status: int, code: str, message: str, server_id: str = "", retry_after: int | None = None
) -> web.Response:
    body = ErrorResponse(code=code, message=message, server_id=server_id).model_dump_json()  # type: ignore[arg-type]
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


def summarize(e: ValidationError, limit: int = 3) -> str:
    parts = [
        f"{'.'.join(str(x) for x in err['loc']) or '(body)'}: {err['msg']}" for err in e.errors()[:limit]
    ]
    more = f" (+{e.error_count() - limit} more)" if e.error_count() > limit else ""
    return "; ".join(parts) + more


async def read_bounded(request: web.Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit` (declared or streamed)."""
    too_large = ServiceError(413, "too_large", f"request body exceeds {limit} bytes")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def check_protocol(declared: object) -> None:
    if declared is not None and declared != PROTOCOL_VERSION:
        raise ServiceError(
            422,
            "protocol_mismatch",
            f"client speaks protocol {declared}, this server speaks {PROTOCOL_VERSION}",
        )


def guard_for(service_key: web.AppKey, server_id: Callable[[Any], str]) -> Any:
    """The middleware of a server of ours (rollout, reward model): auth for work endpoints,
    ServiceError -> ErrorResponse, a request counter per endpoint and status; `server_id` names the
    server in its errors."""

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        service = request.app[service_key]
        sid = server_id(service)
        try:
            if request.path not in OPEN_PATHS:
                expected = f"Bearer {request.app[TOKEN]}".encode()
                if not hmac.compare_digest(request.headers.get(AUTH_HEADER, "").encode(), expected):
                    raise ServiceError(401, "unauthorized", "missing or wrong bearer token")
            response = await handler(request)
        except ServiceError as e:
            if e.status in (413, 500):
                log.warning("%s %s -> %d %s: %s", request.method, request.path, e.status, e.code, e.message)
            response = error(e.status, e.code, e.message, sid, e.retry_after)
        except web.HTTPException as e:
            response = error(e.status, "bad_request", e.reason, sid)
        except Exception as e:
            log.exception("%s %s failed", request.method, request.path)
            response = error(500, "internal", f"{type(e).__name__}: {e}", sid)
        service.metrics.requests.labels(request.path, str(response.status)).inc()
        return response

    return guard


def metrics_handler(service_key: web.AppKey) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET /metrics: the service's own Prometheus registry."""

    async def handle_metrics(request: web.Request) -> web.Response:
        body = generate_latest(request.app[service_key].metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle_metrics


guard = guard_for(SERVICE, lambda service: service.config.server_id)


def parse_body(body: bytes, model: type[M]) -> M:
    """A JSON request body as `model`, its protocol version checked first: 422 naming what is wrong."""
    try:
        raw = json.loads(body)
    except json.JSONDecodeError as e:
        raise ServiceError(422, "bad_request", f"body is not JSON: {e}") from None
    check_protocol(raw.get("protocol_version") if isinstance(raw, dict) else None)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ServiceError(422, "bad_request", summarize(e)) from None


async def handle_generate(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    service.refuse_if_not_ready()  # refuse before reading a large body
    req = parse_body(await read_bounded(request, MAX_GENERATE_BODY_BYTES), GenerateRequest)
    response = await service.generate(req)
    return web.Response(text=response.model_dump_json(), content_type="application/json")


async def handle_weights(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    service.refuse_if_not_ready()
    declared = request.headers.get(WeightBucket.HEADERS["protocol_version"], str(PROTOCOL_VERSION)).strip()
    check_protocol(int(declared) if declared.isdigit() else declared)
    try:
        meta = WeightBucket.from_headers(request.headers)
    except ValidationError as e:
        raise ServiceError(422, "bad_request", f"weight bucket headers: {summarize(e)}") from None
    data = await read_bounded(request, MAX_WEIGHT_BUCKET_BYTES)
    response = await service.add_weights(meta, data)
    return web.Response(text=response.model_dump_json(), content_type="application/json")


async def handle_weight_stream(request: web.Request) -> web.Response:
    """Join the trainer's weight groups and receive a version over them (answers once it is live)."""
    service = request.app[SERVICE]
    req = parse_body(await read_bounded(request, MAX_GENERATE_BODY_BYTES), WeightStreamRequest)
    response = await service.stream_weights(req)
    return web.Response(text=response.model_dump_json(), content_type="application/json")


async def handle_health(request: web.Request) -> web.Response:
    health = request.app[SERVICE].health()
    return web.Response(
        status=200 if health.state == "ready" else 503,
        text=health.model_dump_json(),
        content_type="application/json",
    )


def make_app(service: RolloutService, token: str) -> web.Application:
    app = web.Application(middlewares=[guard], client_max_size=MAX_WEIGHT_BUCKET_BYTES)
    app[SERVICE], app[TOKEN] = service, token
    app.router.add_post("/generate", handle_generate)
    app.router.add_post("/weights", handle_weights)
    app.router.add_post("/weights/stream", handle_weight_stream)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", metrics_handler(SERVICE))
    return app


async def serve(service: RolloutService, token: str, host: str, port: int) -> None:
    """Listen first (health says loading), load, serve until SIGTERM/SIGINT, drain, return."""
    runner = web.AppRunner(
        make_app(service, token), handle_signals=False, access_log=None, shutdown_timeout=5.0
    )
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("%s listening on %s:%d", service.config.server_id, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.ensure_future(service.watch())
    try:
        loading = asyncio.ensure_future(service.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            loading.result()  # a failed load raises here and the process exits non-zero
            await asyncio.wait({stopped, watch}, return_when=asyncio.FIRST_COMPLETED)
        else:
            loading.cancel()
        if watch.done():
            await _answer_in_flight(service)
            raise EngineDead(watch.result())
        log.info("signal received: draining")
        await service.drain()
    finally:
        watch.cancel()
        await runner.cleanup()
        service.close()
        log.info("%s stopped", service.config.server_id)


async def _answer_in_flight(service: RolloutService) -> None:
    """Let requests already in flight get their `engine_dead` answer (and a probe see `failed`)
    before the listener goes away, so a client learns the death rather than a reset connection."""
    deadline = time.monotonic() + DEAD_GRACE_S
    await asyncio.sleep(1.0)
    while service.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
