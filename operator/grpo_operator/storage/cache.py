"""Models from object storage, fetched once per pod into a node-local cache directory.

Called where a workload needs a Hugging Face model directory on local disk: the trainer's
`load_policy` and HF export (tokenizer copy), the rollout server's engine (torch or vLLM).
A local path (a PVC mount included) is returned as it is; an `s3://` prefix is copied to
`<cache_dir>/s3/<bucket>/<key>` (the job's `spec.storage.cacheDir`, an emptyDir on the node's
disk) and that folder is returned.

- **Once per pod.** A file lock beside the folder serialises the pod's processes (the ranks
  of a trainer pod, or the trainer and rollout processes of the local runtime): the first
  downloads, the others wait and find the folder complete.
- **Complete means marked.** The folder gets `.grpo-complete` (the URI and every file's size)
  only after all files arrived; the next start with the marker makes no S3 call at all.
  `model.path` is immutable, so a marked copy cannot go stale within a job.
- **Resumable.** A file arrives as `<name>.part` beside a `<name>.part.json` holding the
  object's size and ETag; an interrupted download continues from the `.part`'s length with
  ranged reads when the object is unchanged, and restarts it when it changed.
- **Progress.** One log line every few seconds: bytes, MB/s, ETA; one line at the end.
Files download in parallel (a sharded checkpoint has many), each streamed in chunks.
"""

import fcntl
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_operator.storage.fs import filesystem, s3_options
from grpo_operator.storage.uri import StorageError, is_remote, scheme, split_s3

log = logging.getLogger("grpo_operator.storage")

COMPLETE = ".grpo-complete"
CHUNK = 8 << 20  # bytes per ranged read
PARALLEL_FILES = 8
ATTEMPTS = 3  # per file, each continuing where the last one stopped
PROGRESS_EVERY_S = 5.0
ENV_CACHE_DIR = "GRPO_CACHE_DIR"


@dataclass(frozen=True)
class FetchReport:
    """What one `fetch` did: the local folder, its size, what crossed the network, how fast."""

    path: str
    files: int
    bytes_total: int
    bytes_fetched: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_fetched / 1e6 / self.seconds if self.seconds > 0 else 0.0


def default_cache_dir() -> str:
    return os.environ.get(ENV_CACHE_DIR) or os.path.join(tempfile.gettempdir(), "grpo-cache")


def model_dir(uri: str, cache_dir: str | None = None) -> str:
    """A local directory with the model at `uri`: `uri` itself when local, else the cached copy."""
    if not is_remote(uri):
        if scheme(uri):
            filesystem(uri)  # raises: a pvc:// the operator did not resolve, or an unknown scheme
        return uri
    return fetch(uri, cache_dir).path


def cached_path(uri: str, cache_dir: str | None = None) -> Path:
    """Where `fetch` puts `uri` (no I/O)."""
    bucket, key = split_s3(uri)
    return Path(cache_dir or default_cache_dir(), "s3", bucket, *[p for p in key.split("/") if p])


def fetch(uri: str, cache_dir: str | None = None) -> FetchReport:
    """Copy every object under the s3:// prefix `uri` into the cache (once per pod, resumable)."""
    dest = cached_path(uri, cache_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(dest.with_name(dest.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process of this pod is fetching it into %s; waiting", uri, dest)
            fcntl.flock(lock, fcntl.LOCK_EX)
        done = _read_marker(dest, uri)
        if done is not None:
            return FetchReport(str(dest), len(done), sum(done.values()), 0, time.monotonic() - started)
        fs, root = filesystem(uri)
        files = _listing(fs, root, uri)
        total = sum(size for size, _ in files.values())
        progress = _Progress(uri, total, started)
        dest.mkdir(parents=True, exist_ok=True)
        log.info("%s: fetching %d files, %s, into %s", uri, len(files), _size(total), dest)
        jobs = [(f"{root}/{rel}", dest / rel, size, etag) for rel, (size, etag) in files.items()]
        with ThreadPoolExecutor(max(1, min(PARALLEL_FILES, len(jobs)))) as pool:
            for _ in pool.map(lambda job: _fetch_file(fs, *job, progress.add), jobs):
                pass
        marker = {"uri": uri, "endpoint": s3_options().get("client_kwargs", {}).get("endpoint_url")}
        marker["files"] = {rel: size for rel, (size, _) in files.items()}
        tmp = dest / (COMPLETE + ".tmp")
        tmp.write_text(json.dumps(marker, indent=1))
        os.replace(tmp, dest / COMPLETE)
        report = FetchReport(str(dest), len(files), total, progress.fetched, time.monotonic() - started)
        log.info(
            "%s: fetched %d files, %s (%s over the network) in %.1f s, %.1f MB/s",
            uri,
            report.files,
            _size(total),
            _size(report.bytes_fetched),
            report.seconds,
            report.mb_per_s,
        )
        return report


def _read_marker(dest: Path, uri: str) -> dict[str, int] | None:
    """The complete copy's {file: size}, or None when `dest` is not a complete copy of `uri`."""
    try:
        marker = json.loads((dest / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("uri") != uri:
        return None
    files = marker.get("files") or {}
    if not all((dest / rel).is_file() and (dest / rel).stat().st_size == n for rel, n in files.items()):
        return None  # something deleted or truncated a file since: fetch what is missing
    return files


def _listing(fs: Any, root: str, uri: str) -> dict[str, tuple[int, str]]:
    """{relative path: (size, etag)} of every object under `root`."""
    try:
        found = fs.find(root, detail=True)
    except (OSError, ValueError) as e:
        raise StorageError(f"{uri}: cannot list the model: {e}") from e
    files: dict[str, tuple[int, str]] = {}
    for path, info in sorted(found.items()):
        rel = path[len(root) :].strip("/")
        if info.get("type") == "directory" or path.endswith("/"):
            continue
        if not rel:
            raise StorageError(f"{uri}: is one object; a model is a folder (config.json, *.safetensors, ...)")
        if rel.endswith((".part", ".part.json", ".lock")) or rel == COMPLETE:
            continue  # never a model file; would collide with our own bookkeeping
        files[rel] = (int(info.get("size") or 0), str(info.get("ETag") or info.get("etag") or ""))
    if not files:
        raise StorageError(
            f"{uri}: no objects under this prefix (check the bucket, the key and the credentials)"
        )
    return files


def _fetch_file(
    fs: Any, src: str, final: Path, size: int, etag: str, progress: Callable[[int], None]
) -> None:
    """Download `src` to `final` through `final.part`, continuing a partial download of the same object."""
    if final.is_file() and final.stat().st_size == size:
        return  # arrived before an earlier attempt stopped
    final.parent.mkdir(parents=True, exist_ok=True)
    part, meta = final.with_name(final.name + ".part"), final.with_name(final.name + ".part.json")
    want = {"size": size, "etag": etag}
    try:
        same = json.loads(meta.read_text()) == want
    except (OSError, ValueError):
        same = False
    if not same or not part.exists() or part.stat().st_size > size:
        part.unlink(missing_ok=True)
        meta.write_text(json.dumps(want))
    for attempt in range(1, ATTEMPTS + 1):
        offset = part.stat().st_size if part.exists() else 0
        try:
            if offset < size:
                with fs.open(src, "rb", block_size=CHUNK, cache_type="none") as f, open(part, "ab") as out:
                    f.seek(offset)
                    while data := f.read(CHUNK):
                        out.write(data)
                        progress(len(data))
            else:
                part.touch()
            break
        except OSError as e:
            if attempt == ATTEMPTS:
                raise StorageError(f"s3://{src}: download failed after {ATTEMPTS} attempts: {e}") from e
            log.warning("s3://%s: %s; continuing from byte %d", src, e, part.stat().st_size)
    got = part.stat().st_size
    if got != size:
        raise StorageError(f"s3://{src}: got {got} bytes, the object has {size}")
    os.replace(part, final)
    meta.unlink(missing_ok=True)


class _Progress:
    """Thread-safe byte counter that logs bytes, MB/s and ETA at most every PROGRESS_EVERY_S."""

    def __init__(self, uri: str, total: int, started: float) -> None:
        self.uri, self.total, self.started = uri, total, started
        self.fetched = 0
        self._lock = threading.Lock()
        self._last = started

    def add(self, n: int) -> None:
        with self._lock:
            self.fetched += n
            now = time.monotonic()
            if now - self._last < PROGRESS_EVERY_S:
                return
            self._last = now
            fetched = self.fetched
        rate = fetched / max(now - self.started, 1e-9)
        eta = (self.total - fetched) / rate if rate > 0 else float("inf")
        log.info(
            "%s: %s of %s (%d%%), %.1f MB/s, ETA %s",
            self.uri,
            _size(fetched),
            _size(self.total),
            100 * fetched // max(self.total, 1),
            rate / 1e6,
            _duration(eta),
        )


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _duration(s: float) -> str:
    if s == float("inf"):
        return "unknown"
    m, s = divmod(int(s), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
