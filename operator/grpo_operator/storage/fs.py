"""`filesystem(uri)`: the fsspec filesystem and in-filesystem path for any path a workload reads.

s3:// goes through s3fs (aiobotocore) with the standard AWS credential chain, so nothing in a
GRPOJob holds keys: EKS Pod Identity (AWS_CONTAINER_CREDENTIALS_FULL_URI), IRSA web identity
(AWS_ROLE_ARN + AWS_WEB_IDENTITY_TOKEN_FILE), or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from
the Secret a job names (`spec.storage.credentialsSecret`). AWS_ENDPOINT_URL (or
AWS_ENDPOINT_URL_S3) and AWS_REGION point it at an S3-compatible store. Local paths use
fsspec's local filesystem. fsspec and s3fs are imported on first use: they come with the
`storage` extra that the trainer and rollout images install, and the operator image, which
never opens a URI, does without them.
"""

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from grpo_operator.storage.uri import PVC_SCHEME, StorageError, scheme, split_s3

if TYPE_CHECKING:
    import fsspec


def s3_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """s3fs keyword arguments from the environment (`env`, default os.environ): endpoint and region;
    credentials are left to botocore's chain (env, web identity, container credentials, instance profile)."""
    env = os.environ if env is None else env
    client: dict[str, Any] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        client["endpoint_url"] = endpoint
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        client["region_name"] = region
    return {"client_kwargs": client} if client else {}


def _require(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError as e:
        raise StorageError(
            f"{module} is not installed; install grpo-operator[storage] (fsspec, s3fs, pyarrow) "
            "to read s3:// and local datasets"
        ) from e


def filesystem(uri: str, env: Mapping[str, str] | None = None) -> "tuple[fsspec.AbstractFileSystem, str]":
    """(filesystem, path inside it) for `uri`: s3://bucket/key → (S3FileSystem, 'bucket/key'),
    a local path → (LocalFileSystem, absolute path). Raises StorageError for pvc:// (the operator
    resolves those before a workload sees them) and for schemes we do not serve."""
    kind = scheme(uri)
    if kind == "pvc":
        raise StorageError(
            f"{uri!r}: {PVC_SCHEME} URIs are mounted by the operator and reach a pod as in-pod paths "
            "(/mnt/pvc/<claim>/...; the local runtime maps them with --pvc CLAIM=DIR); this one "
            "was not resolved"
        )
    if kind == "s3":
        bucket, key = split_s3(uri)
        _require("fsspec")
        s3fs = _require("s3fs")
        return s3fs.S3FileSystem(**s3_options(env)), f"{bucket}/{key}" if key else bucket
    if kind:
        raise StorageError(f"{uri!r}: scheme {kind}:// is not supported (use s3://, pvc:// or a local path)")
    fsspec = _require("fsspec")
    return fsspec.filesystem("file"), os.path.abspath(uri)
