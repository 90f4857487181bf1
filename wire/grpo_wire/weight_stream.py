"""Collective weight streaming: the wire both ends of the `collective` transport speak.

The trainer's `grpo_trainer.weight_sync` sends, the rollout members receive. A weight version
travels as pieces: a contiguous range of elements of one HF-named tensor, flattened (an FSDP2
shard's rows, an EP rank's experts, a slice of a replicated tensor), in the rollout dtype.

Who talks to whom: every receiving member (a rollout server's process, or each worker of its
engine) is in exactly ONE group, with one trainer rank that feeds it (`holdings.lanes`: with every
member holding the whole model, member m is fed by feeder m mod F, F per `feeders_for`; members
holding only their experts get only those, from feeders of their class); the trainer ranks first
exchange among themselves what each feeder forwards. So a member holds one communicator and two
buckets whatever the trainer's size: the reserve does not grow with the senders (1 GiB per worker
at 16 senders would be 96 GiB at 128). Per bucket, in its group (rank 0 = the feeder, ranks 1.. =
its members):
  header   int64[3]  (1, manifest bytes, payload bytes), or (0, 0, 0) after the last bucket
  manifest uint8     JSON list of [name, first element, elements, byte offset, dtype]
  payload  uint8     the bucket, as `runs`: each piece of DIRECT_BYTES or more in a broadcast of
                     its own, the bytes between such pieces together
Broadcasts are asynchronous. A receiver holds two buckets per group (one applied while the next
arrives) and issues every group's transfers from one thread, in rounds every member derives
identically (`receive_rounds`). A receiver reads a bucket's manifest before it posts the payload, so
a large piece can land straight in the member's weights (`place`: the torch engine's parameters
when their dtype is the wire's) instead of its buffer, which saves copying it again. A member
that sees the stream break (its broadcast failed; the trainer saw a server fail) calls the epoch
off in the store (`CallOff`), and every member stops waiting on it within a tenth of a second
instead of at the groups' timeout: nobody blocks where a call-off cannot reach them (members meet
in the store before gloo connects them, the connect runs on a thread of its own, transfers are
polled). The trainer then streams the version again in a new
epoch. A group left with transfers in flight is `retire`d: gloo cannot abort them, and freeing a
`ProcessGroupGloo` waits for them (up to the op timeout) in whichever thread drops the last
reference, so a thread of its own holds it until they end. Groups are plain
`ProcessGroupGloo`/`ProcessGroupNCCL` objects built on a `TCPStore` the trainer hosts, outside
`torch.distributed`'s default group, so trainer processes keep their own world and servers can be
added by forming new groups (a new `epoch`) without touching it.
"""

import datetime
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from grpo_wire import holdings

HEADER_WORDS = 3
ALIGN = 16  # byte alignment of each piece inside a bucket (any dtype can be viewed there)
DIRECT_BYTES = 1 << 20  # a piece this large is broadcast alone, so a receiver can take it in place
STORE_PREFIX = "grpo-weights"
JOIN_TIMEOUT_S = 15.0  # gloo connecting the members of a group, once all of them are known to be up
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + count) of tensor `name` (flattened), at `offset` bytes in a bucket."""

    name: str
    start: int
    count: int
    offset: int
    dtype: str  # torch dtype name without "torch.", e.g. bfloat16


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_manifest(pieces: list[Piece]) -> bytes:
    return json.dumps([[p.name, p.start, p.count, p.offset, p.dtype] for p in pieces]).encode()


def decode_manifest(data: bytes) -> list[Piece]:
    return [Piece(str(n), int(s), int(c), int(o), str(d)) for n, s, c, o, d in json.loads(data)]


def piece_bytes(piece: Piece) -> int:
    return piece.count * dtype_of(piece.dtype).itemsize


def piece_values(payload: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's elements inside a received payload (a view, no copy)."""
    return payload[piece.offset : piece.offset + piece_bytes(piece)].view(dtype_of(piece.dtype))


def runs(pieces: list[Piece], payload_bytes: int) -> list[tuple[int, int, Piece | None]]:
    """The broadcasts that carry a bucket's payload, as (byte offset, bytes, the piece when it is
    alone in its run): every piece of at least DIRECT_BYTES by itself, the bytes around such pieces
    (smaller pieces, alignment gaps) together. Sender and receivers derive them from the manifest
    alike, so their broadcasts match. Broadcasting a large piece alone costs one call; it lets a
    receiver put it in place."""
    out: list[tuple[int, int, Piece | None]] = []
    at = 0
    for p in pieces:
        size = piece_bytes(p)
        if size < DIRECT_BYTES:
            continue
        if p.offset > at:
            out.append((at, p.offset - at, None))
        out.append((p.offset, size, p))
        at = p.offset + size
    if payload_bytes > at:
        out.append((at, payload_bytes - at, None))
    return out


def feeders_for(senders: int, members: int, backend: str, ranks_per_node: int = 1, classes: int = 1) -> int:
    """How many trainer ranks feed members (ranks 0..F-1). NCCL: one per trainer node. Its broadcast
    pipelines through a group, so a feeder sends each byte about once however many members it
    feeds, and each rank's share of the exchange stays 1/ranks-per-node of the model, where a feeder
    per member would double what every rank sends (its chunks to every feeder, then its bucket).
    gloo: as many as there are members, up to every rank (its broadcast sends to each member in
    turn, so the forwarding is spread over the ranks instead). Members in `classes` holding classes
    (`holdings.lanes`): at least one feeder per class where there are ranks enough, so the classes
    stream at once rather than in passes (each class's stream is its own: no feeder is idle)."""
    per_node = ranks_per_node if backend == "nccl" else 1
    base = max(1, min(members, senders // max(1, per_node)))
    return max(1, min(senders, members, max(base, classes)))


def send_bucket(group: "Group", pieces: list[Piece], payload: torch.Tensor) -> list[dist.Work]:
    """Broadcast one bucket in `group` from its rank 0: header, manifest, then the payload runs
    (asynchronous; the tensors stay referenced by the group until the transfers end)."""
    manifest = encode_manifest(pieces)
    device = payload.device
    header = torch.tensor([1, len(manifest), payload.numel()], dtype=torch.int64).to(device)
    meta = torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(device)
    works = [group.broadcast(header), group.broadcast(meta)]
    works += [group.broadcast(payload[lo : lo + n]) for lo, n, _ in runs(pieces, payload.numel())]
    return works


def send_end(group: "Group", device: torch.device) -> dist.Work:
    """The end marker after a member's last bucket."""
    return group.broadcast(torch.zeros(HEADER_WORDS, dtype=torch.int64, device=device))


def make_group(
    store: dist.Store,
    rank: int,
    size: int,
    backend: str,
    timeout_s: float,
    join_timeout_s: float | None = None,
) -> dist.ProcessGroup:
    """A process group of `size` members over `store` (prefix it per group), outside the default
    world; `timeout_s` per operation, `join_timeout_s` (gloo) for connecting the members."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    group = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=join_timeout_s or timeout_s))
    group.set_timeout(timeout)
    return group


class StreamCancelled(Exception):
    """A member of the stream saw it break and called it off for everyone."""


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the trainer's store (rank 0 hosts it)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class CallOff:
    """The call-off flag of one epoch's stream, a key in the trainer's store. Give it a client of
    its own: a TCPStore client runs one operation at a time and gloo's rendezvous blocks in one.
    Calling it asks whether the stream is off (the store at most every `check_every_s`)."""

    def __init__(self, store: dist.Store, epoch: int, check_every_s: float = 0.1) -> None:
        self.store, self.epoch, self.check_every_s = store, epoch, check_every_s
        self._key = f"{STORE_PREFIX}/{epoch}/off"
        self._lock = threading.Lock()
        self._off, self._next_check = False, 0.0

    def __call__(self) -> bool:
        with self._lock:
            if not self._off and time.monotonic() >= self._next_check:
                self._off = self.store.check([self._key])
                self._next_check = time.monotonic() + self.check_every_s
            return self._off

    def call(self) -> None:
        """Tell every member (trainer ranks and servers) to stop waiting on this stream; best
        effort (a store that is gone takes the stream with it)."""
        with self._lock:
            self._off = True
        try:
            self.store.set(self._key, b"1")
        except Exception as e:
            log.warning("calling off weight stream %d: %s", self.epoch, e)

    def check(self) -> None:
        if self():
            raise StreamCancelled(f"weight stream {self.epoch} was called off by one of its members")


def form_group(
    store: dist.Store, rank: int, size: int, backend: str, timeout_s: float, off: CallOff | None = None
) -> "Group":
    """`make_group` once every member has said in the store that it is here: a member that never
    comes is then waited for here, where a call-off or the timeout ends the wait (with who is
    missing). gloo's connect that follows, among members known to be up, gets JOIN_TIMEOUT_S; nothing
    interrupts it, and a member that dies in it after publishing its address holds the others five
    times that long (75 s measured), so under a call-off it runs on a thread of its own (`_connect`)."""
    store.set(f"here/{rank}", b"1")
    keys = [f"here/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if off is not None:
            off.check()
        if time.monotonic() > deadline:
            missing = [r for r in range(size) if not store.check([f"here/{r}"])]
            raise TimeoutError(f"weight group members {missing} did not join within {timeout_s:.0f}s")
        time.sleep(0.02)
    make = functools.partial(
        make_group, store, rank, size, backend, timeout_s, min(timeout_s, JOIN_TIMEOUT_S)
    )
    return Group(make() if off is None else _connect(make, off))


def _connect(make: Callable[[], dist.ProcessGroup], off: CallOff) -> dist.ProcessGroup:
    """`make()` on a daemon thread, waited for while the call-off is watched: a call-off leaves the
    connect to end on its own (a group it forms after all has no transfers: freeing it is quick)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(make())
        except BaseException as e:  # raised below, in the caller
            outcome.append(e)

    thread = threading.Thread(target=run, name="weights-connect", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.05)
        if thread.is_alive():
            off.check()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def wait(work: dist.Work, off: CallOff | None = None) -> None:
    """`work.wait()`, polled, so that a call-off ends it (StreamCancelled). The work itself may
    stay pending in the group: `retire` the group afterwards."""
    if off is not None:
        pause = 5e-5
        while not work.is_completed():
            off.check()
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
    work.wait()


class Group:
    """A weight group and the transfers it started, so that `retire` knows whether any is still in
    flight (every broadcast of this module goes through `broadcast`)."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg
        self._works: list[dist.Work] = []

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Broadcast `tensor` from rank 0 (asynchronous)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self.pg.broadcast([tensor], opts)
        self.settle()
        self._works.append(work)
        return work

    def settle(self) -> int:
        """Forget the transfers that ended (done, failed or timed out), and with them the buffers
        they kept alive; return how many are still in flight."""
        self._works = [w for w in self._works if not w.is_completed()]
        return len(self._works)


RETIRING = "weights-retiring"  # the name of a thread holding a retired group


def _hold_until_settled(group: Group) -> None:
    """Keep `group` until its transfers end; it is then freed as this thread ends (quickly, by
    then). A daemon thread: at interpreter exit nobody frees what it still holds."""
    while group.settle():
        time.sleep(0.5)


def retiring() -> int:
    """Retired groups still held (their transfers have not ended yet)."""
    return sum(t.name == RETIRING and t.is_alive() for t in threading.enumerate())


def retire(group: Group | None) -> None:
    """Release a group this side is done with, without blocking on it: an NCCL communicator is
    aborted now (its queued transfers end and the GPU memory is freed); a gloo group, whose transfers
    nothing can abort, is held by a thread of its own while any is in flight, and freed once they
    end (their peers' failure or the op timeout; the buckets they hold stay until then). Call it
    before dropping the group anywhere else."""
    if group is None:
        return
    try:
        group.pg.abort()
    except Exception as e:
        log.debug("aborting a weight group: %s", e)
    if group.settle():
        threading.Thread(target=_hold_until_settled, args=(group,), name=RETIRING, daemon=True).start()


def _take(kept: dict[int, list[torch.Tensor]] | None, senders: int) -> list[list[torch.Tensor]]:
    """Every sender's receive buffers out of `kept` (emptied): a stream that breaks keeps its
    buffers out of it, since transfers still in flight may write into them."""
    if kept is None:
        return [[] for _ in range(senders)]
    own = [kept.pop(s, []) for s in range(senders)]
    kept.clear()
    return own


def _buffer(own: list[torch.Tensor], slot: int, size: int, device: torch.device) -> torch.Tensor:
    """Slot `slot` of one sender's two receive buffers, at least `size` bytes, allocated once and
    refilled after (a fresh CPU buffer costs its first-touch page faults). Rounded up to ALIGN: a
    bucket but a stream's last falls short of the bucket size by less than ALIGN, so the first
    allocation fits every later bucket."""
    while len(own) <= slot:
        own.append(torch.empty(0, dtype=torch.uint8, device=device))
    if own[slot].numel() < size:
        own[slot] = torch.empty(-(-size // ALIGN) * ALIGN, dtype=torch.uint8, device=device)
    return own[slot][:size]


class Received(NamedTuple):
    """One bucket as a receiver gets it: `pieces` to apply from `payload`, and the pieces `placed`
    (taken straight into the member's weights, not in `payload`)."""

    sender: int
    pieces: list[Piece]
    payload: torch.Tensor
    placed: list[Piece]


Place = Callable[[Piece], torch.Tensor | None]  # where a piece lands in place: its uint8 bytes, or None


def _post_payload(
    group: Group, pieces: list[Piece], payload: torch.Tensor, place: Place | None
) -> tuple[list[dist.Work], list[Piece], list[Piece]]:
    """Post one bucket's payload runs: a lone piece into the spot `place` gives it when it gives
    one, else (and every other run) into `payload` at its offset."""
    works, placed, spots = [], [], {}
    for lo, n, piece in runs(pieces, payload.numel()):
        spot = place(piece) if piece is not None and place is not None else None
        if spot is not None:
            if spot.dtype != torch.uint8 or spot.numel() != n or not spot.is_contiguous():
                raise ValueError(f"weight stream: the spot given for {piece} is not {n} contiguous bytes")
            placed.append(piece)
            spots[piece] = spot
        works.append(group.broadcast(spot if spot is not None else payload[lo : lo + n]))
    return works, [p for p in pieces if p not in spots], placed


def receive_rounds(
    groups: list[Group],
    device: torch.device,
    off: CallOff | None = None,
    kept: dict[int, list[torch.Tensor]] | None = None,
    place: Place | None = None,
) -> Iterator[Received]:
    """Every bucket of every sender's stream, issued from this one thread in an order every member
    derives identically, because NCCL requires the operations of different communicators to be
    issued in the same order on all ranks. First the headers of every sender (in sender order);
    then per round: the manifest of each sender that announced a bucket, and once they arrived,
    per such sender its payload runs (`runs`, derived from its manifest) and next header. Round k+1
    is posted once round k's transfers are done and before round k is handed out, so round k+1's
    payload is on the wire while round k is applied; a sender whose header is the end marker drops
    out. Every member sees the same headers and manifests, so the sequence is the same everywhere.
    Two payload buffers per sender, alternating rounds: consume each bucket before asking for the
    next. `kept`: buffers of an earlier stream, reused and given back when this one ends. `place`:
    where a piece that travels alone may land instead (it is then in `placed`, not `pieces`)."""
    own = _take(kept, len(groups))
    headers = {s: torch.zeros(HEADER_WORDS, dtype=torch.int64, device=device) for s in range(len(groups))}
    posted: dict[int, list[dist.Work]] = {s: [groups[s].broadcast(headers[s])] for s in range(len(groups))}
    current: list[Received] = []  # the round posted but not yet handed out
    slot = 0
    while True:
        for s in posted:
            for work in posted[s]:
                wait(work, off)
        sizes = {s: [int(x) for x in headers[s].tolist()] for s in posted}
        for s in posted:
            if sizes[s][0] == 0:
                groups[s].settle()  # the finished transfers let go of the last payloads
        following = [s for s in posted if sizes[s][0] != 0]
        metas = {s: torch.empty(sizes[s][1], dtype=torch.uint8, device=device) for s in following}
        manifests = [groups[s].broadcast(metas[s]) for s in following]
        for work in manifests:
            wait(work, off)
        posted, nxt = {}, []
        for s in following:  # the next round, into the other buffer of each sender
            pieces = decode_manifest(bytes(metas[s].cpu().numpy()))
            payload = _buffer(own[s], slot, sizes[s][2], device)
            works, rest, placed = _post_payload(groups[s], pieces, payload, place)
            posted[s] = [*works, groups[s].broadcast(headers[s])]
            nxt.append(Received(s, rest, payload, placed))
        yield from current
        if not following:
            break
        current, slot = nxt, 1 - slot
    if kept is not None:
        kept.update({s: b for s, b in enumerate(own) if b})


def receive_all(
    groups: list[Group],
    device: torch.device,
    apply: Callable[[Received], None],
    off: CallOff | None = None,
    kept: dict[int, list[torch.Tensor]] | None = None,
    place: Place | None = None,
) -> int:
    """Receive every sender's stream (`receive_rounds`, `kept` its buffers, `place` where pieces may
    land in place), `apply` each bucket as it comes; return the bytes received. A failure calls the
    stream off, so the other members stop too."""
    received = 0
    try:
        for bucket in receive_rounds(groups, device, off, kept, place):
            apply(bucket)
            received += bucket.payload.numel()
    except StreamCancelled:
        raise
    except BaseException:
        if off is not None:
            off.call()
        raise
    return received


class ReceiverLink:
    """One receiving member's place in the trainer's weight groups, kept across versions and
    formed again when the trainer names a new epoch (servers joined or left, trainer restarted). A
    member is a rollout server's process (torch engine) or one of its engine's workers (vLLM: every
    tensor-parallel worker receives for itself). `buffers`: each sender's two receive buffers,
    kept from one version to the next (`receive_all`'s `kept`) and dropped with the groups."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.groups: list[Group] = []
        self.buffers: dict[int, list[torch.Tensor]] = {}
        self._store: dist.Store | None = None

    def groups_for(
        self,
        *,
        epoch: int,
        host: str,
        port: int,
        backend: str,
        feeders: int,
        members: int,
        member: int,
        timeout_s: float,
        off: CallOff | None = None,
        classes: Sequence[int] | None = None,
    ) -> list[Group]:
        """This member's one group: with the feeder that forwards its class's stream in its pass
        (`holdings.lanes`; `classes`: every member's class, default one class) and the other
        members that feeder feeds there."""
        classes = list(classes) if classes else [0] * members
        key = (epoch, host, port, backend, feeders, tuple(classes), member)
        if key != self.key:
            self.reset()
            tcp = store_client(host, port, timeout_s)
            lanes = holdings.lanes(classes, feeders)
            p, feeder, rank = lanes.place[member]
            prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{epoch}/{p}/{feeder}", tcp)
            self.groups = [form_group(prefixed, rank, lanes.sizes[(p, feeder)], backend, timeout_s, off)]
            self._store, self.key = tcp, key
        return self.groups

    def reset(self) -> None:
        """Forget and release the groups (a broken stream leaves them unusable; a new epoch
        replaces them)."""
        for group in self.groups:
            retire(group)
        self.key, self.groups, self.buffers, self._store = None, [], {}, None
