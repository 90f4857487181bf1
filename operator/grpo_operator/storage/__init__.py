"""One storage layer for every path the API accepts: s3://, pvc:// (resolved by the operator)
and local paths, for the trainer, the rollout servers and the local runtime alike.

    from grpo_operator import storage
    fs, path = storage.filesystem("s3://bucket/data.parquet")
    local = storage.model_dir("s3://bucket/qwen3", cache_dir="/var/cache/grpo")

`uri` (pure string functions), `fs` (fsspec/s3fs, imported lazily), `cache` (models fetched
once per pod into a node-local cache, resumable, one download per pod under a file lock).
Datasets are streamed through `filesystem` by the trainer (`grpo_trainer.data`). Imports only
the stdlib, fsspec/s3fs (lazily) and `grpo_operator.api`, so the workloads may import it
(pyproject's import-linter contracts) and the operator image, without those extras, still
imports `grpo_operator`.
"""

from grpo_operator.storage.cache import FetchReport, fetch, model_dir
from grpo_operator.storage.fs import filesystem, s3_options
from grpo_operator.storage.uri import StorageError, basename, is_remote, join, scheme, split_s3

__all__ = [
    "FetchReport",
    "StorageError",
    "basename",
    "fetch",
    "filesystem",
    "is_remote",
    "join",
    "model_dir",
    "s3_options",
    "scheme",
    "split_s3",
]
