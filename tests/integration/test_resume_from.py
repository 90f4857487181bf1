"""`checkpoint.resumeFrom` resolves what users have at hand, on a local folder and on a real S3 server
(moto's, fixture s3_server): a save, a job's save folder, or another job's checkpoint.path; anything
else is a ResumeFromNotFound error naming the path and what was looked for, never a fresh start.

Saves here are folders with a completion marker, which is all the resolver reads; loading them is
tests/unit/test_grpo_checkpoint.py's business."""

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from grpo_operator.api.status import Reason
from grpo_trainer.checkpoint import find, layout
from grpo_trainer.config import ConfigError

pytestmark = pytest.mark.slow  # the S3 half talks to a real server


def local_tree(tmp_path: Path) -> Callable[[str, bytes], None]:
    def put(rel: str, body: bytes) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)

    return put


@pytest.fixture(params=["local", "s3"])
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Callable[[str, bytes], None]]:
    """(root URI, put(relative path, bytes)) on a local folder or a fresh S3 prefix."""
    if request.param == "local":
        return str(tmp_path), local_tree(tmp_path)
    server: Any = request.getfixturevalue("s3_server")
    bucket = server.make_bucket("resume-from")
    prefix = f"{bucket}/{request.node.name.replace('[', '-').replace(']', '')}-{os.getpid()}"
    env = server.environ()
    env.__enter__()
    request.addfinalizer(lambda: env.__exit__(None, None, None))
    fs = server.fs()

    def put(rel: str, body: bytes) -> None:
        fs.pipe(f"{prefix[5:]}/{rel}", body)

    return prefix, put


def save(put: Callable[[str, bytes], None], job: str, step: int, complete: bool = True) -> str:
    rel = f"{job}/{layout.step_name(step)}"
    put(f"{rel}/{layout.MARKER}" if complete else f"{rel}/rank-00000.distcp", b"{}")
    return rel


def not_found(uri: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        find.resume_from_candidates(uri)
    assert e.value.reason == Reason.RESUME_FROM_NOT_FOUND
    assert "checkpoint.resumeFrom" in str(e.value) and uri in str(e.value)


def test_a_save_a_job_folder_and_a_checkpoint_path_all_resolve(tree) -> None:
    root, put = tree
    for step in (2, 4):
        save(put, "ns/first-u1", step)
    save(put, "ns/first-u1", 6, complete=False)  # interrupted mid-save: never resumed
    job = f"{root}/ns/first-u1"
    newest_first = [f"{job}/{layout.step_name(4)}", f"{job}/{layout.step_name(2)}"]
    assert find.resume_from_candidates(f"{job}/{layout.step_name(2)}") == [f"{job}/{layout.step_name(2)}"]
    assert find.resume_from_candidates(job) == newest_first
    assert find.resume_from_candidates(root) == newest_first  # the old job's checkpoint.path
    assert find.resume_from_candidates(f"{root}/ns") == newest_first  # one level above the job


def test_several_jobs_under_a_checkpoint_path_are_listed_so_the_user_picks(tree) -> None:
    root, put = tree
    save(put, "ns/first-u1", 3)
    save(put, "ns/second-u2", 8)
    save(put, "other/third-u3", 5, complete=False)  # no complete save: not a candidate
    not_found(root, r"holds the saves of 2 jobs.*first-u1 \(newest step 3\).*second-u2 \(newest step 8\)")


def test_missing_empty_incomplete_and_wrong_kind_are_errors_not_a_fresh_start(tree) -> None:
    root, put = tree
    not_found(f"{root}/nothing-here", "does not exist")
    put("a-file", b"not a folder")
    not_found(f"{root}/a-file", "is a file")
    save(put, "ns/crashed-u9", 7, complete=False)
    not_found(f"{root}/ns/crashed-u9/{layout.step_name(7)}", "is an incomplete save")
    looked = r"no complete checkpoint under it \(looked for .*meta\.json.*1 incomplete"
    not_found(f"{root}/ns/crashed-u9", looked)
    put("empty/.keep", b"")
    not_found(f"{root}/empty", "no complete checkpoint under it")
