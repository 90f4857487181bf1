"""torch.distributed.checkpoint storage for one rank: raw tensor bytes + JSON metadata, no pickle.

Used by `grpo_trainer.checkpoint.saver` (writing) and `grpo_trainer.checkpoint.resume` (reading)
through `dcp.async_save` / `dcp.load`, on any path the storage layer serves (s3:// or local).
DCP's own FileSystemWriter pickles its `.metadata` file and stores every tensor as a `torch.save`
pickle; a checkpoint on shared storage is input, so here nothing read back is unpickled:

- `rank-NNNNN.distcp`: the tensors this rank writes, as raw contiguous bytes, back to back.
- `rank-NNNNN.json`: for every key, its dtype, global size and chunks (offsets, sizes), and for
  every chunk its byte range in the data file and a CRC-32 of those bytes.

Each rank saves on its own (`no_dist=True`: DCP's plan exchange would pickle plans across the
gang); `merge` joins the rank files listed in a save's marker into one `Metadata`, so any rank
of any gang shape plans its reads from the global key space and reads only the byte ranges of
the chunks it needs. Only tensors are accepted: a non-tensor value is a programming error here.
"""

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from grpo_operator import storage
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

FORMAT = "grpo-dcp/1"


class CorruptCheckpoint(Exception):
    """A save that cannot be read back as written (missing file, bad checksum, bad metadata)."""


def data_file(rank: int) -> str:
    return f"rank-{rank:05d}.distcp"


def meta_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise CorruptCheckpoint(f"unknown dtype {name!r}")
    return value


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's contents as raw bytes (no copy when it is contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


@dataclass(frozen=True)
class Chunk:
    """Where one chunk of one key lives: file, byte range, checksum, and its dtype and shape."""

    file: str
    offset: int
    length: int
    crc32: int
    dtype: str
    sizes: tuple[int, ...]


def write_file(fs: Any, path: str, data: bytes) -> None:
    with fs.open(path, "wb") as f:
        f.write(data)
        _sync(f)


def _sync(f: Any) -> None:
    """fsync local files (durable before the marker names them); object stores are durable on close."""
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError):
        pass


class RankWriter(StorageWriter, BlockingAsyncStager):
    """Writes one rank's part of a save into `save_dir` (an s3:// or local directory)."""

    def __init__(self, save_dir: str, rank: int) -> None:
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=False)
        self.save_dir, self.rank = save_dir, rank
        self.fs, self.path = storage.filesystem(save_dir)
        self.digest = ""  # sha256 of this rank's metadata file, once written
        self.nbytes = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.fs.makedirs(self.path, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name, results, offset = data_file(self.rank), [], 0
        with self.fs.open(f"{self.path}/{name}", "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise TypeError(f"checkpoint value {item.index.fqn!r} is not a tensor")
                tensor = planner.resolve_data(item)
                data = tensor_bytes(tensor)
                f.write(data)
                chunk = Chunk(
                    name, offset, len(data), zlib.crc32(data), str(tensor.dtype), tuple(tensor.shape)
                )
                results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=chunk))
                offset += len(data)
            _sync(f)
        self.nbytes = offset
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        where = {r.index: r.storage_data for rs in results for r in rs}
        keys = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise TypeError(f"checkpoint value {fqn!r} is not a tensor")
            chunks = []
            for c in md.chunks:
                at: Chunk = where[MetadataIndex(fqn, c.offsets)]
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes), **at.__dict__})
            keys[fqn] = {"dtype": str(md.properties.dtype), "size": list(md.size), "chunks": chunks}
        body = json.dumps({"format": FORMAT, "rank": self.rank, "keys": keys}, sort_keys=True).encode()
        write_file(self.fs, f"{self.path}/{meta_file(self.rank)}", body)
        self.digest = hashlib.sha256(body).hexdigest()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.save_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def read_rank_meta(fs: Any, path: str, rank: int, sha256: str) -> dict[str, Any]:
    """One rank's metadata, checked against the digest the save's marker recorded."""
    try:
        body = fs.cat_file(f"{path}/{meta_file(rank)}")
    except (OSError, FileNotFoundError) as e:
        raise CorruptCheckpoint(f"{meta_file(rank)}: cannot read: {e}") from e
    if hashlib.sha256(body).hexdigest() != sha256:
        raise CorruptCheckpoint(f"{meta_file(rank)}: sha256 differs from the marker's")
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise CorruptCheckpoint(f"{meta_file(rank)}: not JSON: {e}") from e
    if doc.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{meta_file(rank)}: format {doc.get('format')!r}, expected {FORMAT}")
    return doc


def merge(docs: list[dict[str, Any]], prefer_rank: int) -> Metadata:
    """One DCP `Metadata` over every rank's keys; a chunk written twice is read from `prefer_rank`."""
    docs = sorted(docs, key=lambda d: d["rank"] != prefer_rank)  # own file first: pod-local reads
    sd_meta: dict[str, TensorStorageMetadata] = {}
    where: dict[MetadataIndex, Chunk] = {}
    for doc in docs:
        for fqn, k in doc["keys"].items():
            md = sd_meta.setdefault(
                fqn,
                TensorStorageMetadata(TensorProperties(dtype=_dtype(k["dtype"])), torch.Size(k["size"]), []),
            )
            for c in k["chunks"]:
                index = MetadataIndex(fqn, c["offsets"])
                if index in where:
                    continue
                md.chunks.append(ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])))
                where[index] = Chunk(
                    c["file"], c["offset"], c["length"], c["crc32"], c["dtype"], tuple(c["sizes"])
                )
    return Metadata(state_dict_metadata=dict(sd_meta), storage_data=where, storage_meta=StorageMeta())


class MergedReader(StorageReader):
    """Reads the chunks a rank's load plan asks for, by byte range, checking each CRC-32."""

    def __init__(self, save_dir: str, metadata: Metadata) -> None:
        self.fs, self.path = storage.filesystem(save_dir)
        self.metadata = metadata
        self.nbytes = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        where: dict[MetadataIndex, Chunk] = self.metadata.storage_data
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(where[req.storage_index].file, []).append(req)
        for name, reqs in per_file.items():
            try:
                f = self.fs.open(f"{self.path}/{name}", "rb")
            except (OSError, FileNotFoundError) as e:
                raise CorruptCheckpoint(f"{name}: cannot open: {e}") from e
            with f:
                for req in sorted(reqs, key=lambda r: where[r.storage_index].offset):
                    chunk = where[req.storage_index]
                    f.seek(chunk.offset)
                    data = f.read(chunk.length)
                    if len(data) != chunk.length or zlib.crc32(data) != chunk.crc32:
                        raise CorruptCheckpoint(
                            f"{name}: {req.storage_index.fqn} at byte {chunk.offset}: checksum mismatch"
                        )
                    self.nbytes += len(data)
                    dtype = _dtype(chunk.dtype)
                    if data:
                        tensor = torch.frombuffer(bytearray(data), dtype=dtype).reshape(chunk.sizes)
                    else:
                        tensor = torch.empty(chunk.sizes, dtype=dtype)
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != tensor.size():
                        raise CorruptCheckpoint(
                            f"{req.storage_index.fqn}: size {tensor.size()} != {target.size()}"
                        )
                    target.copy_(tensor)
                    planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True
