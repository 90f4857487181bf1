"""The path rules of `grpo_operator.storage.check` on local paths: each field's path is missing,
empty, unreadable or of the wrong kind, and says so with the field, the path and the reason.
(The same rules against a real S3 server: tests/integration/test_storage_check_s3.py.)"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_operator.api.status import Reason
from grpo_operator.storage.check import Expect, PathError, check, probe_write


def model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    return folder


def refused(field: str, path: Path | str, expect: Expect, reason: Reason, words: str) -> PathError:
    with pytest.raises(PathError) as e:
        check(field, str(path), expect)
    assert e.value.reason == reason, str(e.value)
    assert str(e.value).startswith(f"{field} {path}: ") and words in e.value.why, str(e.value)
    return e.value


def unprivileged(code: str) -> dict[str, str]:
    """Run `code` (which prints one JSON line) where file permissions bind: as root, without the
    capabilities that let root read and write anything."""
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: file permissions cannot be made to bind")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


CHECK_IN_CHILD = """
import json
from grpo_operator.storage.check import Expect, PathError, check, probe_write
field, path, expect = {args!r}
try:
    {call}
    print(json.dumps({{}}))
except PathError as e:
    print(json.dumps({{"reason": str(e.reason), "message": str(e)}}))
"""


def child(
    field: str, path: Path, expect: Expect, call: str = "check(field, path, Expect(expect))"
) -> dict[str, str]:
    return unprivileged(CHECK_IN_CHILD.format(args=(field, str(path), str(expect)), call=call))


def test_a_model_folder_resolves(tmp_path: Path) -> None:
    check("spec.model.path", str(model(tmp_path / "m")), Expect.MODEL)


def test_model_missing_empty_wrong_kind_and_incomplete(tmp_path: Path) -> None:
    field = "spec.model.path"
    refused(field, tmp_path / "nope", Expect.MODEL, Reason.PATH_NOT_FOUND, "does not exist")
    (tmp_path / "empty").mkdir()
    refused(field, tmp_path / "empty", Expect.MODEL, Reason.PATH_EMPTY, "is an empty folder")
    (tmp_path / "config.json").write_text("{}")
    refused(
        field, tmp_path / "config.json", Expect.MODEL, Reason.PATH_WRONG_KIND, "is a file; expected a Hugging"
    )
    weights = model(tmp_path / "no-config")
    (weights / "config.json").unlink()
    refused(field, weights, Expect.MODEL, Reason.MODEL_INVALID, "has no config.json")
    folder = model(tmp_path / "config-is-a-folder")
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    refused(field, folder, Expect.MODEL, Reason.MODEL_INVALID, "has no config.json")
    broken = model(tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    refused(field, broken, Expect.MODEL, Reason.MODEL_INVALID, "config.json is not valid JSON")
    pickles = model(tmp_path / "pickles")
    (pickles / "model.safetensors").rename(pickles / "pytorch_model.bin")
    refused(field, pickles, Expect.MODEL, Reason.MODEL_INVALID, "has no *.safetensors")


def test_model_unreadable(tmp_path: Path) -> None:
    folder = model(tmp_path / "m")
    (folder / "config.json").chmod(0)
    out = child("spec.model.referencePath", folder, Expect.MODEL)
    assert out["reason"] == Reason.PATH_UNREADABLE
    assert out["message"].startswith(f"spec.model.referencePath {folder}: cannot read it: PermissionError")


def test_dataset_file_or_folder_resolves(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text('{"prompt": "x"}\n')
    check("spec.dataset.path", str(tmp_path / "d"), Expect.DATASET)
    check("spec.dataset.path", str(tmp_path / "d" / "a.jsonl"), Expect.DATASET)


def test_dataset_missing_empty_and_wrong_kind(tmp_path: Path) -> None:
    field = "spec.dataset.eval.path"
    refused(field, tmp_path / "none.jsonl", Expect.DATASET, Reason.PATH_NOT_FOUND, "does not exist")
    (tmp_path / "empty.jsonl").write_bytes(b"")
    refused(field, tmp_path / "empty.jsonl", Expect.DATASET, Reason.DATASET_EMPTY, "is an empty file")
    (tmp_path / "nothing").mkdir()
    refused(field, tmp_path / "nothing", Expect.DATASET, Reason.DATASET_EMPTY, "is an empty folder")
    (tmp_path / "zeros").mkdir()
    (tmp_path / "zeros" / "a.jsonl").write_bytes(b"")
    refused(field, tmp_path / "zeros", Expect.DATASET, Reason.DATASET_EMPTY, "all empty")
    (tmp_path / "notes").mkdir()  # a folder, but of no data files
    (tmp_path / "notes" / "README.txt").write_text("prompts are elsewhere")
    refused(field, tmp_path / "notes", Expect.DATASET, Reason.PATH_WRONG_KIND, "no .jsonl/.json/.parquet/.pq")


def test_dataset_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "x"}\n')
    path.chmod(0)
    out = child("spec.dataset.path", path, Expect.DATASET)
    assert out["reason"] == Reason.PATH_UNREADABLE, out


def test_checkpoint_root_may_be_missing_but_never_a_file_nor_unwritable(tmp_path: Path) -> None:
    field = "spec.checkpoint.path"
    check(field, str(tmp_path / "new" / "deeper"), Expect.CHECKPOINT_ROOT)  # created at the first save
    (tmp_path / "a-file").write_text("x")
    refused(
        field,
        tmp_path / "a-file",
        Expect.CHECKPOINT_ROOT,
        Reason.PATH_WRONG_KIND,
        "is a file; expected a folder",
    )
    refused(field, tmp_path / "a-file" / "below", Expect.CHECKPOINT_ROOT, Reason.PATH_WRONG_KIND, "is a file")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    for path in (locked, locked / "job"):
        out = child(field, path, Expect.CHECKPOINT_ROOT)
        assert out["reason"] == Reason.PATH_UNWRITABLE, out
    out = child(field, locked, Expect.CHECKPOINT_ROOT, call="probe_write(field, path)")
    assert out["reason"] == Reason.PATH_UNWRITABLE and "cannot write it: PermissionError" in out["message"]


def test_write_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    probe_write("spec.checkpoint.path", str(tmp_path / "ckpt" / "ns" / "job-uid"))
    assert list((tmp_path / "ckpt" / "ns" / "job-uid").iterdir()) == []


def test_resume_from_missing_file_and_empty(tmp_path: Path) -> None:
    field = "spec.checkpoint.resumeFrom"
    refused(field, tmp_path / "nope", Expect.SAVES, Reason.PATH_NOT_FOUND, "does not exist")
    (tmp_path / "meta.json").write_text("{}")
    refused(field, tmp_path / "meta.json", Expect.SAVES, Reason.PATH_WRONG_KIND, "is a file; expected a save")
    (tmp_path / "empty").mkdir()
    refused(field, tmp_path / "empty", Expect.SAVES, Reason.PATH_EMPTY, "is an empty folder")


def test_resume_from_unreadable(tmp_path: Path) -> None:
    (tmp_path / "saves" / "step-1").mkdir(parents=True)
    (tmp_path / "saves").chmod(0)
    out = child("spec.checkpoint.resumeFrom", tmp_path / "saves", Expect.SAVES)
    assert out["reason"] == Reason.PATH_UNREADABLE, out
