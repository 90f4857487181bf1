"""grpo_operator.storage's pure URI functions and the refusals of `filesystem` that need no server."""

import pytest
from grpo_operator import storage


def test_scheme_and_is_remote() -> None:
    assert storage.scheme("s3://b/k") == "s3" and storage.is_remote("s3://b/k")
    assert storage.scheme("pvc://claim/p") == "pvc" and not storage.is_remote("pvc://claim/p")
    assert storage.scheme("/data/x") == "" and not storage.is_remote("/data/x")
    assert storage.scheme("rel/dir:with/colon") == ""


def test_join_never_doubles_slashes() -> None:
    assert storage.join("s3://b/ckpt/", "ns", "/job/", "step-1") == "s3://b/ckpt/ns/job/step-1"
    assert storage.join("s3://b", "k") == "s3://b/k"
    assert storage.join("/mnt/pvc/fsx", "a") == "/mnt/pvc/fsx/a"
    assert storage.join("/", "a") == "/a"
    assert storage.join("rel", "", "a") == "rel/a"


def test_split_s3() -> None:
    assert storage.split_s3("s3://bucket/a/b/") == ("bucket", "a/b")
    assert storage.split_s3("s3://bucket") == ("bucket", "")
    with pytest.raises(storage.StorageError, match="not an s3"):
        storage.split_s3("/local")


def test_filesystem_refuses_a_raw_pvc_uri_and_unknown_schemes() -> None:
    with pytest.raises(storage.StorageError, match=r"pvc:// URIs are mounted by the operator.*--pvc"):
        storage.filesystem("pvc://fsx/models/qwen")
    with pytest.raises(storage.StorageError, match="scheme gs:// is not supported"):
        storage.filesystem("gs://bucket/x")


def test_local_paths_are_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    fs, path = storage.filesystem("data/x.jsonl")
    assert path == str(tmp_path / "data" / "x.jsonl") and fs.protocol[0] == "file"


def test_s3_options_follow_the_aws_environment(monkeypatch) -> None:
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    assert storage.s3_options() == {}  # IRSA / Pod Identity on AWS: botocore's chain does the rest
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert storage.s3_options() == {
        "client_kwargs": {"endpoint_url": "http://minio:9000", "region_name": "eu-west-1"}
    }
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:9000")
    assert storage.s3_options()["client_kwargs"]["endpoint_url"] == "http://s3-only:9000"


def test_the_operator_imports_without_the_storage_extra() -> None:
    """The operator image has no fsspec/s3fs/pyarrow: importing them must wait for first use."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('fsspec', 's3fs', 'pyarrow'): sys.modules[m] = None  # as if not installed\n"
        "import grpo_operator.storage, grpo_operator.local.plan, grpo_operator.cli\n"
        "from grpo_operator import storage\n"
        "try:\n    storage.filesystem('s3://b/k')\nexcept storage.StorageError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "install grpo-operator[storage]" in out.stdout
