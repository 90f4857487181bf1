"""What a storage URI names: pure string functions, no I/O, no third-party imports.

Every path the API accepts is one of three kinds (api/spec.py `URI_PATTERN`): `s3://bucket/key`
(read and written by the workloads through s3fs), `pvc://claim/path` (mounted by the operator:
the renderer rewrites it into an in-pod path, render/storage.py, and the local runtime into a
local folder, local/plan.py) and a plain local path. Used by `grpo_operator.storage.fs` and
by the local runtime's checks.
"""

S3_SCHEME = "s3://"
PVC_SCHEME = "pvc://"


class StorageError(ValueError):
    """A URI that cannot be read or written here; the message names the URI and the reason."""


def scheme(uri: str) -> str:
    """'s3', 'pvc', another scheme's name, or '' for a local path."""
    head, sep, _ = uri.partition("://")
    return head.lower() if sep and "/" not in head else ""


def is_remote(uri: str) -> bool:
    """True for object-store URIs the workloads reach over the network (s3://)."""
    return scheme(uri) == "s3"


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key) of an `s3://bucket/key` URI; the key has no leading or trailing '/'."""
    if scheme(uri) != "s3":
        raise StorageError(f"{uri!r} is not an s3:// URI")
    bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise StorageError(f"{uri!r} names no bucket")
    return bucket, key.strip("/")


def join(uri: str, *parts: str) -> str:
    """`uri` with `parts` appended, '/'-separated whatever the scheme (no doubled slashes)."""
    out = uri.rstrip("/") if uri.rstrip("/") else uri
    for part in parts:
        part = str(part).strip("/")
        if part:
            out = f"{out}/{part}" if not out.endswith("/") else f"{out}{part}"
    return out


def basename(uri: str) -> str:
    """The last non-empty segment of `uri` ('' for a bucket root or '/')."""
    path = uri.split("://", 1)[-1].rstrip("/")
    return path.rsplit("/", 1)[-1] if "/" in path else ("" if scheme(uri) == "s3" else path)
