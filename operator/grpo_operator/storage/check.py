"""Does a path the spec names hold what its field expects? One rule per kind of field.

Used offline by `grpo-operator validate --check-paths` (`grpo_operator.validation.paths`, with the
credentials of the machine it runs on) and in the pod by the trainer before any GPU work
(`grpo_trainer.inputs`, `grpo_trainer.data`, `grpo_trainer.checkpoint.find`), so a path is judged by
the same words in both places. A broken path raises `PathError`: the field, the URI, why, and the API
reason the job's status carries, e.g. `spec.dataset.path s3://b/x.jsonl: does not exist`.
Offline a dataset is judged by its bytes (an empty file, a folder of empty files); the pod counts
its usable rows (`grpo_trainer.data.load_rows`).
"""

import json
import os
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from grpo_operator.api.status import Reason
from grpo_operator.storage.fs import filesystem
from grpo_operator.storage.uri import StorageError, is_remote, split_s3

PARQUET_SUFFIXES = (".parquet", ".pq")
DATA_SUFFIXES = (".jsonl", ".json", *PARQUET_SUFFIXES)
MODEL_FOLDER = "a Hugging Face model folder (config.json, *.safetensors)"
SAVES_FOLDER = "a save (.../step-N), a job's save folder or a checkpoint.path"
WRITE_PROBE = ".grpo-write-probe"
POD_CREDENTIALS = "the pod's AWS credentials (spec.storage.credentialsSecret, or Pod Identity / IRSA)"
NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError")


class Expect(StrEnum):
    """What a field's path must hold."""

    MODEL = "model"  # model.path, model.referencePath
    DATASET = "dataset"  # dataset.path, dataset.eval.path: a data file, or a folder of them
    CHECKPOINT_ROOT = "checkpoint root"  # checkpoint.path: a folder, created when missing
    SAVES = "saves"  # checkpoint.resumeFrom: a folder; which save it names is the trainer's call


class PathError(StorageError):
    """A path that does not hold what its field expects; `str()` is `<field> <uri>: <why>`."""

    def __init__(self, field: str, uri: str, why: str, reason: Reason) -> None:
        super().__init__(f"{field} {uri}: {why}")
        self.field, self.uri, self.why, self.reason = field, uri, why, reason


def check(
    field: str, uri: str, expect: Expect, *, env: Mapping[str, str] | None = None, credentials: str = ""
) -> None:
    """Raise PathError when `uri` (local or s3://; pvc:// resolved by the caller) cannot serve `field`.

    `env` stands in for os.environ when choosing the S3 endpoint and region; `credentials` says
    where the AWS credentials came from, for an access-denied message."""
    probe = _Probe(field, uri, env, credentials)
    info = probe.info(probe.path)
    if expect == Expect.CHECKPOINT_ROOT:
        _checkpoint_root(probe, info)
        return
    if info is None:
        raise probe.error("does not exist", Reason.PATH_NOT_FOUND)
    folder = info.get("type") == "directory"
    if expect == Expect.MODEL:
        _model(probe, folder)
    elif expect == Expect.DATASET:
        _dataset(probe, info, folder)
    elif not folder:
        raise probe.error(f"is a file; expected {SAVES_FOLDER}", Reason.PATH_WRONG_KIND)
    elif not probe.listing(probe.path):
        raise probe.error(f"is an empty folder; expected {SAVES_FOLDER}", Reason.PATH_EMPTY)


def probe_write(field: str, uri: str, *, credentials: str = "") -> None:
    """Write and delete one small object under `uri`, so a checkpoint folder the job cannot write
    fails the job at its start rather than at its first save, hours in."""
    probe = _Probe(field, uri, None, credentials)
    target = f"{probe.path}/{WRITE_PROBE}"
    try:
        if not is_remote(uri):
            probe.fs.makedirs(probe.path, exist_ok=True)  # s3fs would create a missing bucket instead
        probe.fs.pipe(target, b"grpo")
        probe.fs.rm(target)
    except Exception as e:  # s3fs raises OSError or botocore's own errors
        raise probe.failure(e, writing=True) from e


class _Probe:
    """One path's filesystem and the errors that name its field."""

    def __init__(self, field: str, uri: str, env: Mapping[str, str] | None, credentials: str) -> None:
        self.field, self.uri, self.credentials = field, uri, credentials
        self.fs, self.path = filesystem(uri, env=env)
        self.fs.invalidate_cache()  # s3fs lists once per instance; another process may have written since

    def error(self, why: str, reason: Reason) -> PathError:
        return PathError(self.field, self.uri, why, reason)

    def failure(self, e: Exception, *, writing: bool = False) -> PathError:
        verb = "write" if writing else "read"
        whose = f" with {self.credentials}" if self.credentials else ""
        if isinstance(e, PermissionError) and is_remote(self.uri):
            return self.error(f"cannot {verb} it: access denied{whose}: {e}", Reason.STORAGE_ACCESS_DENIED)
        if type(e).__name__ in NO_CREDENTIALS:  # botocore's, not imported here
            return self.error(
                f"cannot {verb} it: no AWS credentials found{whose}: {e}", Reason.STORAGE_ACCESS_DENIED
            )
        reason = Reason.PATH_UNWRITABLE if writing else Reason.PATH_UNREADABLE
        return self.error(f"cannot {verb} it: {type(e).__name__}: {e}", reason)

    def info(self, path: str) -> dict[str, Any] | None:
        try:
            return dict(self.fs.info(path))
        except (FileNotFoundError, NotADirectoryError):  # NotADirectory: a file on the way
            return None
        except Exception as e:  # see failure()
            raise self.failure(e) from e

    def listing(self, path: str, *, recursive: bool = False) -> dict[str, dict[str, Any]]:
        """{path: info} of the files in the folder `path` (all levels when recursive)."""
        try:
            if recursive:
                return dict(self.fs.find(path, detail=True))
            entries = self.fs.ls(path, detail=True)
        except Exception as e:  # see failure()
            raise self.failure(e) from e
        return {str(e["name"]): e for e in entries}

    def head(self, path: str, n: int = 1) -> bytes:
        try:
            with self.fs.open(path, "rb") as f:
                return bytes(f.read(n))
        except Exception as e:  # see failure()
            raise self.failure(e) from e


def _model(probe: _Probe, folder: bool) -> None:
    if not folder:
        raise probe.error(f"is a file; expected {MODEL_FOLDER}", Reason.PATH_WRONG_KIND)
    entries = probe.listing(probe.path)
    if not entries:
        raise probe.error(f"is an empty folder; expected {MODEL_FOLDER}", Reason.PATH_EMPTY)
    names = {os.path.basename(name.rstrip("/")): e for name, e in entries.items()}
    config = names.get("config.json")
    if config is None or config.get("type") == "directory":
        found = ", ".join(sorted(names)[:8])
        raise probe.error(
            f"has no config.json; expected {MODEL_FOLDER} (found: {found})", Reason.MODEL_INVALID
        )
    text = probe.head(f"{probe.path}/config.json", 1 << 20)
    try:
        json.loads(text)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise probe.error(f"config.json is not valid JSON: {e}", Reason.MODEL_INVALID) from None
    if not any(n.endswith(".safetensors") and e.get("type") != "directory" for n, e in names.items()):
        raise probe.error(f"has no *.safetensors weights; expected {MODEL_FOLDER}", Reason.MODEL_INVALID)


def _dataset(probe: _Probe, info: dict[str, Any], folder: bool) -> None:
    if not folder:
        if not info.get("size"):
            raise probe.error("is an empty file: a dataset with no rows", Reason.DATASET_EMPTY)
        probe.head(probe.path)  # readable, not only listed
        return
    files = {
        p: e for p, e in probe.listing(probe.path, recursive=True).items() if e.get("type") != "directory"
    }
    if not files:
        raise probe.error(
            f"is an empty folder; expected {'/'.join(DATA_SUFFIXES)} files", Reason.DATASET_EMPTY
        )
    data = sorted(p for p in files if p.endswith(DATA_SUFFIXES))
    if not data:
        found = ", ".join(os.path.basename(p) for p in sorted(files)[:8])
        why = f"is a folder with no {'/'.join(DATA_SUFFIXES)} files (found: {found})"
        raise probe.error(why, Reason.PATH_WRONG_KIND)
    sized = [p for p in data if files[p].get("size")]
    if not sized:
        raise probe.error(
            f"holds {len(data)} data file(s), all empty: a dataset with no rows", Reason.DATASET_EMPTY
        )
    probe.head(sized[0])


def _checkpoint_root(probe: _Probe, info: dict[str, Any] | None) -> None:
    if info is not None:
        if info.get("type") != "directory":
            raise probe.error(
                "is a file; expected a folder (checkpoints are written under it)", Reason.PATH_WRONG_KIND
            )
        if not is_remote(probe.uri) and not os.access(probe.path, os.W_OK | os.X_OK):
            raise probe.error("is a folder this user cannot write", Reason.PATH_UNWRITABLE)
        return
    if is_remote(probe.uri):
        bucket, _ = split_s3(probe.uri)
        if probe.info(bucket) is None:
            raise probe.error(f"bucket {bucket!r} does not exist", Reason.PATH_NOT_FOUND)
        return
    parent = os.path.dirname(probe.path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise probe.error(f"cannot be created: {parent} is a file", Reason.PATH_WRONG_KIND)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise probe.error(
            f"cannot be created: {parent} is a folder this user cannot write", Reason.PATH_UNWRITABLE
        )
