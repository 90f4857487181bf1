"""The path rules of `grpo_operator.storage.check` against a real S3 server (moto's, over HTTP):
missing, empty, wrong kind and unreadable (credentials the store refuses) for every path field, and
`validate --check-paths` printing them for s3:// paths."""

import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpo_operator.api.status import Reason
from grpo_operator.cli import main
from grpo_operator.storage.check import Expect, PathError, check, probe_write

from tests.support.ports import free_port


@pytest.fixture
def bucket(s3_server) -> Iterator[str]:
    """A fresh prefix in a bucket of the session's server, with this process's env pointed at it."""
    with s3_server.environ():
        yield f"{s3_server.make_bucket('path-checks')}/{uuid.uuid4().hex[:8]}"


def put(s3_server, uri: str, body: bytes) -> None:
    s3_server.fs().pipe(uri[len("s3://") :], body)


def refused(field: str, uri: str, expect: Expect, reason: Reason, words: str) -> None:
    with pytest.raises(PathError) as e:
        check(field, uri, expect)
    assert e.value.reason == reason, str(e.value)
    assert str(e.value).startswith(f"{field} {uri}: ") and words in e.value.why, str(e.value)


def test_model_on_s3(s3_server, bucket: str) -> None:
    field = "spec.model.path"
    put(s3_server, f"{bucket}/m/config.json", b"{}")
    put(s3_server, f"{bucket}/m/model.safetensors", b"\0")
    check(field, f"{bucket}/m", Expect.MODEL)
    refused(field, f"{bucket}/nothing", Expect.MODEL, Reason.PATH_NOT_FOUND, "does not exist")
    refused(field, "s3://no-such-bucket-h8/m", Expect.MODEL, Reason.PATH_NOT_FOUND, "does not exist")
    refused(field, f"{bucket}/m/config.json", Expect.MODEL, Reason.PATH_WRONG_KIND, "is a file")
    put(s3_server, f"{bucket}/weights-only/model.safetensors", b"\0")
    refused(field, f"{bucket}/weights-only", Expect.MODEL, Reason.MODEL_INVALID, "has no config.json")


def test_dataset_on_s3(s3_server, bucket: str) -> None:
    field = "spec.dataset.path"
    put(s3_server, f"{bucket}/d/a.jsonl", b'{"prompt": "x"}\n')
    check(field, f"{bucket}/d", Expect.DATASET)
    check(field, f"{bucket}/d/a.jsonl", Expect.DATASET)
    refused(field, f"{bucket}/d/b.jsonl", Expect.DATASET, Reason.PATH_NOT_FOUND, "does not exist")
    put(s3_server, f"{bucket}/empty.jsonl", b"")
    refused(field, f"{bucket}/empty.jsonl", Expect.DATASET, Reason.DATASET_EMPTY, "is an empty file")
    put(s3_server, f"{bucket}/zeros/a.parquet", b"")
    refused(field, f"{bucket}/zeros", Expect.DATASET, Reason.DATASET_EMPTY, "all empty")
    put(s3_server, f"{bucket}/notes/README.md", b"x")
    refused(field, f"{bucket}/notes", Expect.DATASET, Reason.PATH_WRONG_KIND, "a folder with no .jsonl")


def test_checkpoint_root_and_resume_from_on_s3(s3_server, bucket: str) -> None:
    field = "spec.checkpoint.path"
    check(field, f"{bucket}/ckpt", Expect.CHECKPOINT_ROOT)  # not there yet: written at the first save
    probe_write(field, f"{bucket}/ckpt/ns/job-u1")
    assert s3_server.fs().find(f"{bucket[5:]}/ckpt") == []  # the probe left nothing
    refused(field, "s3://no-such-bucket-h8/ckpt", Expect.CHECKPOINT_ROOT, Reason.PATH_NOT_FOUND, "bucket")
    put(s3_server, f"{bucket}/a-file", b"x")
    refused(field, f"{bucket}/a-file", Expect.CHECKPOINT_ROOT, Reason.PATH_WRONG_KIND, "is a file")
    field = "spec.checkpoint.resumeFrom"
    refused(field, f"{bucket}/old-job", Expect.SAVES, Reason.PATH_NOT_FOUND, "does not exist")
    refused(field, f"{bucket}/a-file", Expect.SAVES, Reason.PATH_WRONG_KIND, "is a file; expected a save")


@pytest.fixture(scope="module")
def locked_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second moto server that checks credentials from its first request: it knows no key."""
    port = free_port()
    log = tmp_path_factory.mktemp("locked-s3") / "server.log"
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": "0", "PATH": "/usr/bin:/bin"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2)
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"moto did not start:\n{log.read_text(errors='replace')}")
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_credentials_the_store_refuses_are_access_denied_naming_the_field(
    s3_server, locked_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", locked_store)
    for field, expect in (("spec.model.path", Expect.MODEL), ("spec.dataset.path", Expect.DATASET)):
        with pytest.raises(PathError) as e:
            check(field, "s3://models-h8/qwen", expect, credentials="the test's keys")
        assert e.value.reason == Reason.STORAGE_ACCESS_DENIED, str(e.value)
        assert str(e.value).startswith(
            f"{field} s3://models-h8/qwen: cannot read it: access denied with the test's keys"
        )
    with pytest.raises(PathError) as e:
        probe_write("spec.checkpoint.path", "s3://models-h8/ckpt")
    assert e.value.reason == Reason.STORAGE_ACCESS_DENIED and "cannot write it" in str(e.value)


def test_validate_check_paths_reads_s3_with_this_environment(
    s3_server, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    put(s3_server, f"{bucket}/m/config.json", b"{}")
    put(s3_server, f"{bucket}/m/model.safetensors", b"\0")
    job = tmp_path / "job.yaml"
    job.write_text(
        f"""\
apiVersion: grpo.dev/v1alpha1
kind: GRPOJob
metadata:
  name: s3-paths
spec:
  model:
    path: {bucket}/m
  dataset:
    path: {bucket}/train.jsonl
  reward:
    functions:
      - builtin: exact_match
  checkpoint:
    path: {bucket}/ckpt
    resumeFrom: {bucket}/m/config.json
  storage:
    credentialsSecret: s3-keys
"""
    )
    assert main(["validate", "--check-paths", str(job)]) == 1
    err = capsys.readouterr().err
    assert f"{job}:9: spec.dataset.path: {bucket}/train.jsonl: does not exist" in err
    assert f"{job}:15: spec.checkpoint.resumeFrom: {bucket}/m/config.json: is a file" in err
    assert "spec.model.path" not in err and "spec.checkpoint.path" not in err
    assert "warning: spec.storage.credentialsSecret: not checked offline" in err
