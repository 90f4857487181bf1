"""Collective weight streaming: one group per sending trainer rank, buckets broadcast to every server.

Both ends of the `collective` weight-sync transport use this module (the trainer's
`grpo_trainer.weight_sync` sends, the rollout service receives). A weight version travels as
pieces: a contiguous range of elements of one HF-named tensor, flattened (an FSDP2 shard's rows,
an EP rank's experts, a slice of a replicated tensor). A trainer rank packs its pieces, converted
to the rollout dtype, into a bucket of at most `bucket_bytes` and broadcasts, per bucket, in its
own group (rank 0 = that trainer rank, ranks 1.. = the servers):
  header   int64[3]  (1, manifest bytes, payload bytes), or (0, 0, 0) after the last bucket
  manifest uint8     JSON list of [name, first element, elements, byte offset, dtype]
  payload  uint8     the bucket
Broadcasts are asynchronous and the sender fills one buffer while the other is on the wire, so a
sender holds at most two buckets; a receiver holds one per sender group. Groups are plain
`ProcessGroupGloo`/`ProcessGroupNCCL` objects built on a `TCPStore` the trainer hosts, outside
`torch.distributed`'s default group, so trainer processes keep their own world and servers can be
added by forming new groups (a new `epoch`) without touching it.
"""

import datetime
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

HEADER_WORDS = 3
ALIGN = 16  # byte alignment of each piece inside a bucket (any dtype can be viewed there)
STORE_PREFIX = "grpo-weights"
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


def piece_values(payload: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's elements inside a received payload (a view, no copy)."""
    dtype = dtype_of(piece.dtype)
    size = torch.empty((), dtype=dtype).element_size()
    return payload[piece.offset : piece.offset + piece.count * size].view(dtype)


def make_group(store: dist.Store, rank: int, size: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    """A process group of `size` members over `store` (prefix it per group), outside the default world."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def abort(group: dist.ProcessGroup | None) -> None:
    """Release a group this side is done with (its connections, an NCCL communicator) now, not
    whenever the object is collected; best effort. Its other members are not woken by it: over
    gloo a server still waiting in a broken group waits for the group's timeout."""
    if group is None:
        return
    try:
        group.abort()
    except Exception as e:
        log.debug("aborting a weight group: %s", e)


def group_store(host: str, port: int, epoch: int, sender: int, timeout_s: float, *, master: bool = False):
    """The store of sender `sender`'s group in `epoch`; `master` hosts the TCPStore (trainer rank 0)."""
    tcp = dist.TCPStore(
        host, port, is_master=master, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return tcp, dist.PrefixStore(f"{STORE_PREFIX}/{epoch}/{sender}", tcp)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


class BucketSender:
    """Packs (name, first element, 1-D values) items into buckets and broadcasts them in `group`.

    `peak_bytes` counts every buffer this sender allocates (buckets, headers, manifests) at its
    highest: at most two buckets plus a few kilobytes, whatever the model size."""

    def __init__(
        self, group: dist.ProcessGroup, dtype: torch.dtype, bucket_bytes: int, device: torch.device
    ) -> None:
        self.group, self.dtype, self.device = group, dtype, device
        self.bucket_bytes = max(ALIGN, bucket_bytes - bucket_bytes % ALIGN)
        self.esize = torch.empty((), dtype=dtype).element_size()
        self._buffers: list[torch.Tensor] = []
        self._pending: list[tuple[list, list]] = [([], []), ([], [])]  # per buffer: (works, tensors kept)
        self._live_bytes = 0
        self.peak_bytes = 0
        self.buckets = 0
        self.sent_bytes = 0

    def _alloc(self, n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype, device=self.device)
        self._live_bytes += t.numel() * t.element_size()
        self.peak_bytes = max(self.peak_bytes, self._live_bytes)
        return t

    def _free(self, tensors: list[torch.Tensor]) -> None:
        self._live_bytes -= sum(t.numel() * t.element_size() for t in tensors)

    def _wait(self, slot: int) -> None:
        works, kept = self._pending[slot]
        for work in works:
            work.wait()
        self._free(kept)
        self._pending[slot] = ([], [])

    def _buffer(self, slot: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(self._alloc(self.bucket_bytes))
        return self._buffers[slot]

    def _flush(self, slot: int, pieces: list[Piece], fill: int) -> None:
        manifest = encode_manifest(pieces)
        header = self._alloc(HEADER_WORDS, torch.int64)
        header.copy_(torch.tensor([1, len(manifest), fill], dtype=torch.int64))
        meta = self._alloc(len(manifest))
        meta.copy_(torch.frombuffer(bytearray(manifest), dtype=torch.uint8))
        works = [_broadcast(self.group, t) for t in (header, meta, self._buffers[slot][:fill])]
        self._pending[slot] = (works, [header, meta])
        self.buckets += 1
        self.sent_bytes += fill

    def send(self, items: Iterable[tuple[str, int, torch.Tensor]]) -> None:
        """Stream every item, then the end marker; returns when everything is on the wire."""
        slot, fill, pieces = 0, 0, []
        buf = self._buffer(slot)
        for name, start, values in items:
            values = values.reshape(-1)
            done = 0
            while done < values.numel():
                offset = -(-fill // ALIGN) * ALIGN
                room = (self.bucket_bytes - offset) // self.esize
                if room <= 0:
                    self._flush(slot, pieces, fill)
                    slot, fill, pieces = 1 - slot, 0, []
                    self._wait(slot)  # the other buffer's broadcast must be done before it is refilled
                    buf = self._buffer(slot)
                    continue
                n = min(room, values.numel() - done)
                buf[offset : offset + n * self.esize].view(self.dtype).copy_(values[done : done + n])
                pieces.append(Piece(name, start + done, n, offset, dtype_name(self.dtype)))
                fill, done = offset + n * self.esize, done + n
        if pieces:
            self._flush(slot, pieces, fill)
        end = self._alloc(HEADER_WORDS, torch.int64).zero_()
        work = _broadcast(self.group, end)
        for s in (0, 1):
            self._wait(s)
        work.wait()
        self._free([end])

    def close(self) -> None:
        self._free(self._buffers)
        self._buffers = []


def receive_buckets(
    group: dist.ProcessGroup, device: torch.device
) -> Iterator[tuple[list[Piece], torch.Tensor]]:
    """(pieces, payload) per bucket of one sender's stream, until its end marker. The payload buffer
    is reused for the next bucket: consume each before asking for the next."""
    buffer = torch.empty(0, dtype=torch.uint8, device=device)
    while True:
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=device)
        _broadcast(group, header).wait()
        kind, manifest_len, payload_len = (int(x) for x in header.tolist())
        if kind == 0:
            return
        meta = torch.empty(manifest_len, dtype=torch.uint8, device=device)
        _broadcast(group, meta).wait()
        if buffer.numel() < payload_len:
            buffer = torch.empty(payload_len, dtype=torch.uint8, device=device)
        payload = buffer[:payload_len]
        _broadcast(group, payload).wait()
        yield decode_manifest(bytes(meta.cpu().numpy())), payload


def receive_all(
    groups: list[dist.ProcessGroup], device: torch.device, apply: Callable[[list[Piece], torch.Tensor], None]
) -> int:
    """Receive every sender's stream at once (a thread per group; `apply` runs under one lock);
    return the bytes received. The first failure is raised after every thread stopped."""
    lock = threading.Lock()
    errors: list[BaseException] = []
    received = [0]

    def one(group: dist.ProcessGroup) -> None:
        try:
            for pieces, payload in receive_buckets(group, device):
                with lock:
                    apply(pieces, payload)
                    received[0] += payload.numel()
        except BaseException as e:  # reported by the caller, with the other threads joined
            errors.append(e)

    threads = [
        threading.Thread(target=one, args=(g,), name=f"weights-recv-{i}") for i, g in enumerate(groups)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return received[0]


class ReceiverLink:
    """A rollout server's membership in the trainer's weight groups, kept across versions and
    formed again when the trainer names a new epoch (servers joined or left, trainer restarted)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.groups: list[dist.ProcessGroup] = []
        self._store: dist.Store | None = None

    def groups_for(
        self,
        *,
        epoch: int,
        host: str,
        port: int,
        backend: str,
        senders: int,
        servers: int,
        rank: int,
        timeout_s: float,
    ) -> list[dist.ProcessGroup]:
        key = (epoch, host, port, backend, senders, servers, rank)
        if key != self.key:
            self.reset()
            tcp = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
            self.groups = [
                make_group(
                    dist.PrefixStore(f"{STORE_PREFIX}/{epoch}/{s}", tcp),
                    1 + rank,
                    1 + servers,
                    backend,
                    timeout_s,
                )
                for s in range(senders)
            ]
            self._store, self.key = tcp, key
        return self.groups

    def reset(self) -> None:
        """Forget and release the groups (a broken stream leaves them unusable; a new epoch
        replaces them)."""
        for group in self.groups:
            abort(group)
        self.key, self.groups, self._store = None, [], None
