"""One receiving member's part of a streamed weight version: join the groups, receive, apply, judge.

A member holds one rank in one of the trainer's weight groups (`grpo_wire.weight_stream`):
the rollout server's own process (`LocalMember`, for an engine that does not receive itself) or
each worker of an engine that does (`engines.base.StreamReceiver`: vLLM's tensor-parallel workers,
`engines.vllm_stream`), so a bucket lands on the device that uses it, with no host copy and no
fan-out. Every member receives every bucket and applies it to its own model (vLLM's `load_weights`
keeps the shard its worker needs). The semantics are the server's, per member: a version refused
before the stream is still consumed (the senders never hang); it goes live only when every element
of every announced tensor arrived exactly once (`Coverage`). The result is an `Outcome` record, not
an exception, so a worker in another process can report it through vLLM's `collective_rpc` and the
server `combine`s its members' outcomes into one answer. Whatever fails in the updater (its begin,
a bucket, its finish, its abort) ends as an outcome too, never as an exception out of `receive`.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from grpo_wire import weight_stream
from grpo_wire.protocol import WeightStreamRequest

from grpo_rollout.engines.base import StreamedUpdate, streamed_update
from grpo_rollout.weights import BadBucket, Coverage

if TYPE_CHECKING:
    from grpo_rollout.engines.base import Engine, StreamReceiver

log = logging.getLogger(__name__)

Kind = Literal["live", "refused", "cancelled", "broken"]
SEVERITY: dict[str, int] = {"live": 0, "refused": 1, "cancelled": 2, "broken": 3}


@dataclass(frozen=True)
class Outcome:
    """What a member made of one streamed version. `loaded`: some bucket reached the model, which
    is therefore mixed unless the version went live."""

    kind: Kind
    message: str = ""
    loaded: bool = False
    updated: int = 0  # tensors updated (when live)
    received_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Outcome":
        return cls(**data)


def combine(outcomes: Sequence[Outcome]) -> Outcome:
    """A server's outcome from its members': the worst one (a single member that broke or refused
    keeps the version from going live on the server), loaded if any member loaded."""
    if not outcomes:
        raise ValueError("combine: no member outcomes (an engine with no stream members)")
    worst = max(outcomes, key=lambda o: SEVERITY[o.kind])
    return Outcome(
        kind=worst.kind,
        message=worst.message,
        loaded=any(o.loaded for o in outcomes),
        updated=worst.updated,
        received_bytes=sum(o.received_bytes for o in outcomes),
    )


def receive(
    link: weight_stream.ReceiverLink,
    req: WeightStreamRequest,
    member: int,
    device: torch.device,
    updater: StreamedUpdate | None,
) -> Outcome:
    """Receive `req`'s version as member `member` (0-based among all `req.members`) into `updater`,
    or consume and drop it when `updater` is None (the caller refused the version already)."""
    off = weight_stream.CallOff(
        weight_stream.store_client(req.store_host, req.store_port, req.timeout_s), req.epoch
    )
    if off():  # called off before this member started it: nobody is sending
        return Outcome("cancelled", f"weight stream {req.epoch} was called off by one of its members")
    refusal = None if updater is not None else "refused before the stream"
    holding, experts = req.holding(member), frozenset(req.expert_tensors)
    try:
        held = {name: holding.ranges(name, shape, experts) for name, shape in req.tensors.items()}
    except ValueError as e:  # experts the version's tensors do not have: consume the stream, refuse it
        held, refusal, updater = {}, f"member {member}: {e}", None
    coverage = Coverage(req.tensors, held)  # live only with every element this member holds
    if updater is not None:
        try:
            updater.begin_update(req.tensors)
        except ValueError as e:
            refusal, updater = str(e), None
        except Exception as e:  # the engine failed to open it: consume the stream, refuse the version
            refusal = f"opening the update failed: {type(e).__name__}: {e}{close(updater)}"
            updater = None
    loaded = False
    destination = getattr(updater, "destination", None)

    def place(p: weight_stream.Piece) -> torch.Tensor | None:
        """The piece's spot in the engine's weights, while the version is still accepted."""
        nonlocal loaded
        if refusal is not None or destination is None:
            return None
        spot = destination(p.name, p.start, p.count, weight_stream.dtype_of(p.dtype), device)
        loaded = loaded or spot is not None  # the weights change as it lands
        return spot

    def apply(bucket: weight_stream.Received) -> None:
        nonlocal refusal, loaded
        if refusal is not None:
            return  # consume and drop: the senders finish, the refusal is answered after
        try:
            for p in bucket.placed + bucket.pieces:
                coverage.add(p.name, p.start, p.count)
            loaded = True
            assert updater is not None
            values = [(p.name, p.start, weight_stream.piece_values(bucket.payload, p)) for p in bucket.pieces]
            if values:
                updater.load_bucket(values)
        except (ValueError, BadBucket) as e:
            refusal = str(e)

    try:
        groups = link.groups_for(
            epoch=req.epoch,
            host=req.store_host,
            port=req.store_port,
            backend=req.backend,
            feeders=req.feeders,
            members=req.members,
            member=member,
            timeout_s=req.timeout_s,
            off=off,
            classes=req.classes,
        )
        received = weight_stream.receive_all(groups, device, apply, off, link.buffers, place)
    except Exception as e:
        cancelled = isinstance(e, weight_stream.StreamCancelled)
        if not cancelled:
            log.warning(
                "weight version %d (stream %d, member %d) broke: %s", req.version, req.epoch, member, e
            )
            off.call()  # no member waits on groups this one left
        link.reset()  # the groups are broken: the trainer forms new ones next time
        why = close(updater) if updater is not None else ""
        return Outcome("cancelled" if cancelled else "broken", f"{e}{why}", loaded)
    if refusal is None and (missing := coverage.missing()):
        refusal = f"{len(missing)} tensor(s) incomplete after the stream, e.g. {missing[:3]}"
    if refusal is not None:
        if updater is not None:
            refusal += close(updater)
        return Outcome("refused", refusal, loaded, received_bytes=received)
    assert updater is not None
    try:
        updated = updater.finish_update()
    except ValueError as e:  # refused before it changed anything (e.g. a tensor never completed)
        return Outcome("refused", f"{e}{close(updater)}", loaded, received_bytes=received)
    except Exception as e:  # failed part-way (e.g. out of memory in vLLM's processing): weights unknown
        log.warning("weight version %d (member %d) failed at its finish: %s", req.version, member, e)
        why = f"finishing the update failed: {type(e).__name__}: {e}{close(updater)}"
        return Outcome("refused", why, True, received_bytes=received)
    return Outcome("live", "", loaded, updated, received)


def close(updater: StreamedUpdate) -> str:
    """Abort `updater`'s update, which never raises out of here: a member always answers with an
    outcome (an exception would leave the version's end, and vLLM's wake-up, to nobody). Returns
    what to add to the outcome's message when the abort itself failed."""
    try:
        updater.abort_update()
    except Exception as e:
        log.warning("aborting a weight update failed: %s", e)
        return f"; aborting it failed too: {type(e).__name__}: {e}"
    return ""


class LocalMember:
    """The server's own process as its one member, for an engine that does not receive streams
    itself (the torch engine): buckets land on the engine's device (on the host over gloo) and go
    into its `StreamedUpdate` (or a `StagedUpdate`)."""

    stream_members = 1

    def __init__(self, engine: "Engine", link: weight_stream.ReceiverLink) -> None:
        self.engine, self.link = engine, link
        held = getattr(engine, "held_experts", None)  # an engine keeping only some routed experts
        self.stream_holdings: list[list[int] | None] | None = None if held is None else [list(held)]

    def receive_stream(self, request: WeightStreamRequest, refused: bool) -> Outcome:
        device = "cpu" if request.backend == "gloo" else getattr(self.engine, "device", "cuda")
        updater = None if refused else streamed_update(self.engine)
        return receive(self.link, request, request.first_member, torch.device(device), updater)


def stream_receiver(engine: "Engine", link: weight_stream.ReceiverLink) -> "StreamReceiver":
    """The engine itself when it receives streams in its workers, else the server's process."""
    if hasattr(engine, "receive_stream") and hasattr(engine, "stream_members"):
        return engine  # type: ignore[return-value]
    return LocalMember(engine, link)
