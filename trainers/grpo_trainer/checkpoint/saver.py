"""Asynchronous saves: stage a snapshot, write it in the background, seal it with the marker.

Used by the training loop (`grpo_trainer.loop`). `save` returns once this rank's tensors are
copied (DCP's `async_save` staging); writing them (every rank its own files, in parallel, to S3
or a shared or local directory) and sealing run on one background thread, so a step never waits
for storage. At most one save is in flight: the next `save`, `wait` and the end of training
wait for it. Sealing: every rank reports over a dedicated gloo group (tensors only, no pickled
objects) whether its files are durable and the sha256 of its metadata file; rank 0 then writes
the marker and prunes saves beyond `keepLast`. A failed save is raised on the next `save`/`wait`.
"""

import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from grpo_operator import storage
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from grpo_trainer.checkpoint import layout
from grpo_trainer.checkpoint.dcp_io import RankWriter, write_file
from grpo_trainer.config import ConfigError, RankInfo

log = logging.getLogger(__name__)
# Each rank saves and loads on its own (no_dist=True) on purpose; DCP warns about that every time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
# Fault injection for tests: seconds a save stays unsealed after its files are written.
ENV_SEAL_DELAY = "GRPO_TEST_CHECKPOINT_SEAL_DELAY_S"


def check_root(root: str, info: RankInfo) -> None:
    """Every rank, at start: write, read back, list and delete a probe under `root`.

    ConfigError (the job fails at once, naming the path) when this rank cannot."""
    name = f".probe-rank-{info.rank:05d}"
    try:
        fs, path = storage.filesystem(root)
        fs.makedirs(path, exist_ok=True)
        fs.pipe_file(f"{path}/{name}", b"ok")
        if fs.cat_file(f"{path}/{name}") != b"ok":
            raise OSError("the probe read back differs")
        fs.invalidate_cache(path)
        if not any(str(p).rstrip("/").endswith(name) for p in fs.ls(path, detail=False)):
            raise OSError("the probe written is not listed")
        fs.rm_file(f"{path}/{name}")
    except (OSError, ValueError) as e:  # StorageError is a ValueError
        raise ConfigError(
            f"checkpoint root {root}: rank {info.rank} (pod {info.pod_index}) cannot write, read and list "
            f"it: {e}. Use an s3:// or pvc:// path every trainer pod reaches, with write access"
        ) from e


def list_saves(root: str) -> tuple[list[int], list[int]]:
    """(complete, incomplete) save steps under `root`; ([], []) when it does not exist."""
    fs, path = storage.filesystem(root)
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return [], []
    steps = [s for s in (layout.step_of(str(e)) for e in entries) if s is not None]
    complete = [s for s in steps if fs.exists(f"{path}/{layout.step_name(s)}/{layout.MARKER}")]
    return complete, sorted(set(steps) - set(complete))


class Saver:
    """One rank's side of the gang's checkpoints under the contract's checkpointDir."""

    def __init__(
        self, root: str, info: RankInfo, group: dist.ProcessGroup, *, keep_last: int, spec: dict
    ) -> None:
        self.root, self.info, self.group = root, info, group
        self.keep_last, self.spec = keep_last, spec
        self._pending: Future | None = None
        self.last: tuple[str, int] | None = None  # newest sealed save (rank 0 knows)
        self.delay = float(os.environ.get(ENV_SEAL_DELAY, "0") or 0)

    def save(self, state: layout.TrainState, tensors: dict[str, torch.Tensor]) -> None:
        """Collective in effect (every rank saves the same step). Returns after staging."""
        self.wait()
        save_dir = storage.join(self.root, layout.step_name(state.step))
        writer = RankWriter(save_dir, self.info.rank)
        t0 = time.monotonic()
        upload = dcp.async_save(
            tensors,
            storage_writer=writer,
            planner=DefaultSavePlanner(),
            process_group=self.group,
            no_dist=True,
        )
        staged = time.monotonic() - t0
        self._pending = Future()
        args = (upload, writer, layout.TrainState(**vars(state)), save_dir, t0, self._pending)
        # a daemon thread: a rank failing elsewhere exits without waiting for a seal that cannot finish
        threading.Thread(target=self._seal, args=args, name="checkpoint-seal", daemon=True).start()
        log.info("checkpoint step %d: staged %d tensors in %.3fs, writing in the background",
                 state.step, len(tensors), staged)  # fmt: skip

    def _seal(
        self,
        upload: Future,
        writer: RankWriter,
        state: layout.TrainState,
        save_dir: str,
        t0: float,
        done: Future,
    ) -> None:
        try:
            self._seal_now(upload, writer, state, save_dir, t0)
            done.set_result(None)
        except BaseException as e:
            done.set_exception(e)

    def _seal_now(
        self, upload: Future, writer: RankWriter, state: layout.TrainState, save_dir: str, t0: float
    ) -> None:
        error = None
        try:
            upload.result()
        except BaseException as e:  # DCP's CheckpointException too: tell the gang, never leave it waiting
            error = e
            log.error(
                "checkpoint step %d: rank %d failed to write %s: %s", state.step, self.info.rank, save_dir, e
            )
        written = time.monotonic() - t0
        if self.delay:
            time.sleep(self.delay)
        mine = torch.zeros(65, dtype=torch.uint8)
        if error is None:
            mine[0] = 1
            mine[1:] = torch.frombuffer(bytearray(writer.digest.encode()), dtype=torch.uint8)
        reports = [torch.zeros_like(mine) for _ in range(self.info.world_size)]
        dist.all_gather(reports, mine, group=self.group)
        failed = [r for r, rep in enumerate(reports) if rep[0] != 1]
        if failed:
            raise RuntimeError(
                f"checkpoint step {state.step} was not sealed: ranks {failed} failed to write it"
            )
        if self.info.is_main:
            digests = {r: bytes(rep[1:].tolist()).decode() for r, rep in enumerate(reports)}
            body = layout.marker(
                state,
                world_size=self.info.world_size,
                ep_size=self.info.ep_size,
                ranks=digests,
                spec=self.spec,
            )
            fs, path = storage.filesystem(save_dir)
            write_file(fs, f"{path}/{layout.MARKER}", body)
            self._prune(state.step)
            sealed = time.monotonic() - t0
            log.info("checkpoint step %d sealed at %s: rank 0 wrote %d bytes in %.3fs, sealed after %.3fs",
                     state.step, save_dir, writer.nbytes, written, sealed)  # fmt: skip
        self.last = (save_dir, state.step)

    def _prune(self, current: int) -> None:
        complete, incomplete = list_saves(self.root)
        old, stale = layout.to_prune(complete, incomplete, current=current, keep_last=self.keep_last)
        fs, path = storage.filesystem(self.root)
        for step in old + stale:
            d = f"{path}/{layout.step_name(step)}"
            try:
                if fs.exists(f"{d}/{layout.MARKER}"):
                    fs.rm_file(f"{d}/{layout.MARKER}")  # first: a half-deleted save is never "complete"
                fs.rm(d, recursive=True)
            except OSError as e:
                log.warning("could not remove old checkpoint %s: %s", d, e)

    def wait(self) -> None:
        """Block until the save in flight (if any) is sealed; raise if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
