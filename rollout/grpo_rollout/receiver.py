"""A rollout server's weight versions, however they arrive: the one home of weight sync on this side.

Two transports, one set of rules (the trainer's counterpart is `grpo_trainer.pusher.WeightPusher`):
- HTTP (`push`): buckets are staged whole (`weights.WeightStager`) and handed to the engine in one
  call once the last one is in. A re-send of the live version is harmless; an older one is refused.
- collective (`stream`): the version arrives over the trainer's groups (`weight_stream`), through
  the engine's members (`stream_member`: this process, or each vLLM worker), applied bucket by
  bucket and live only when every element of every announced tensor arrived. A version that is not
  newer than the live one is refused but still consumed, so the senders never hang; a stream that
  breaks half-way leaves the weights `torn`, and the server takes no work until a whole version.
Either way the swap runs on the engine's thread with no generation beside it (`run_alone`, given by
the service), and the live version changes there too: a response is sampled with exactly one
version and reports that one. Refusals are `ServiceError`s the HTTP shell answers as they are.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from grpo_wire import weight_stream
from grpo_wire.protocol import WeightBucket, WeightStreamRequest, WeightUpdateResponse

from grpo_rollout import stream_member
from grpo_rollout.engines.base import Engine
from grpo_rollout.errors import ServiceError
from grpo_rollout.metrics import RolloutMetrics
from grpo_rollout.weights import BadBucket, WeightConflict, WeightStager

log = logging.getLogger(__name__)

T = TypeVar("T")
RunAlone = Callable[[Callable[[], T]], Awaitable[T]]  # run on the engine thread, no generation beside it


class StreamBroken(RuntimeError):
    """A member's weight groups failed mid-stream (a peer died, a transfer timed out)."""


class WeightReceiver:
    """The weight versions of one rollout server: what is live, what is being staged or streamed,
    whether the weights are whole. The service calls `push` and `stream` and reads `live_version`,
    `torn` and `receiving`; nothing else in the server touches weights."""

    def __init__(self, server_id: str, metrics: RolloutMetrics, run_alone: RunAlone) -> None:
        self.server_id, self.metrics, self.run_alone = server_id, metrics, run_alone
        self.stager = WeightStager()
        self.link = weight_stream.ReceiverLink()  # this process's place in the trainer's groups
        self.torn = False  # a streamed version broke half-way: weights are mixed until the next one
        self.torn_why = ""  # what broke it, as the members said (generation's refusal repeats it)
        self.receiving = False  # a streamed version is on its way in
        self._lock = asyncio.Lock()  # one version at a time, whichever transport brings it

    @property
    def live_version(self) -> int:
        return self.stager.live_version

    def members(self, engine: Engine | None) -> int:
        """Ranks this server takes in every weight group (1 until the engine is loaded: a server
        that is not ready is not put in the groups)."""
        if engine is None:
            return 1
        return stream_member.stream_receiver(engine, self.link).stream_members

    def holdings(self, engine: Engine | None) -> list[list[int] | None] | None:
        """Per member, the routed experts it keeps (None: every member the whole model)."""
        if engine is None:
            return None
        return getattr(stream_member.stream_receiver(engine, self.link), "stream_holdings", None)

    async def push(self, engine: Engine, meta: WeightBucket, data: bytes) -> WeightUpdateResponse:
        """One HTTP bucket; the version goes live when its last bucket is in."""
        async with self._lock:
            try:
                complete = self.stager.add(meta, data)
            except WeightConflict as e:
                raise ServiceError(409, "weight_version_conflict", str(e)) from None
            except BadBucket as e:
                raise ServiceError(422, "bad_request", str(e)) from None
            updated = 0
            if complete is not None:
                t0 = time.monotonic()
                try:
                    updated = await self.run_alone(lambda: self._apply(engine, complete, meta.version))
                except ValueError as e:
                    self.stager.discard()
                    raise ServiceError(
                        422, "bad_request", f"weight version {meta.version} rejected: {e}"
                    ) from None
                self._went_live(meta.version, updated, t0, "")
            return WeightUpdateResponse(
                server_id=self.server_id,
                live_version=self.stager.live_version,
                staged_version=self.stager.staged_version,
                buckets_received=len(self.stager.buckets),
                applied=complete is not None,
                parameters_updated=updated,
            )

    async def stream(self, engine: Engine, req: WeightStreamRequest) -> WeightUpdateResponse:
        """Receive `req.version` over the trainer's groups (joining them first for a new epoch)."""
        async with self._lock:
            t0 = time.monotonic()
            try:
                updated = await self.run_alone(lambda: self._stream(engine, req))
            except weight_stream.StreamCancelled as e:
                message = f"weight version {req.version}: {e}"
                raise ServiceError(409, "weight_stream_cancelled", message) from None
            except WeightConflict as e:
                raise ServiceError(409, "weight_version_conflict", str(e)) from None
            except (ValueError, BadBucket) as e:
                raise ServiceError(
                    422, "weight_version_refused", f"weight version {req.version} rejected: {e}"
                ) from None
            self._went_live(req.version, updated, t0, ", streamed")
            return WeightUpdateResponse(
                server_id=self.server_id,
                live_version=self.stager.live_version,
                applied=True,
                parameters_updated=updated,
            )

    def _went_live(self, version: int, updated: int, t0: float, how: str) -> None:
        self.metrics.weight_version.set(version)
        self.metrics.weight_loads.inc()
        log.info("weight version %d live%s (%d tensors, %.2fs)", version, how, updated, time.monotonic() - t0)

    def _apply(self, engine: Engine, buckets: list[bytes], version: int) -> int:
        """On the engine thread: swap the weights and the version number together, so the next
        generate on this thread can never report the old version for the new weights."""
        updated = engine.load_weights(buckets)
        self.stager.applied(version)
        self.torn = False
        return updated

    def _stream(self, engine: Engine, req: WeightStreamRequest) -> int:
        """On the engine thread: join, receive, apply, go live."""
        self.receiving = True
        try:
            return self._receive(engine, req)
        finally:
            self.receiving = False

    def _receive(self, engine: Engine, req: WeightStreamRequest) -> int:
        """The version through the engine's members (its workers, or this process): a version not
        newer than the live one is refused but still consumed, so the senders never hang."""
        refusal: Exception | None = None
        if req.version <= self.stager.live_version:
            refusal = WeightConflict(
                f"weight version {req.version} is not newer than the live {self.stager.live_version}"
            )
        receiver = stream_member.stream_receiver(engine, self.link)
        outcome = receiver.receive_stream(req, refusal is not None)
        if outcome.kind != "live" and outcome.loaded:  # buckets may already be in the live weights
            self.torn, self.torn_why = True, f"weight version {req.version}: {outcome.message}"
        if outcome.kind == "cancelled":
            raise weight_stream.StreamCancelled(outcome.message)
        if outcome.kind == "broken":
            raise StreamBroken(f"weight version {req.version} (stream {req.epoch}) broke: {outcome.message}")
        if refusal is not None:
            raise refusal
        if outcome.kind == "refused":
            raise BadBucket(outcome.message)
        self.stager.applied(req.version)
        self.torn = False
        return outcome.updated
