"""The storage layer against a real S3-compatible server process (moto's, fixture s3_server).

Every fetch runs in a fresh subprocess with the server's AWS_* env, as a pod would, and reports
what crossed the network; the tests compare files byte for byte and count bytes, never time.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

FETCH = """
import json, logging, sys
from grpo_operator import storage
logging.basicConfig(level=logging.INFO, format="%(message)s")
r = storage.fetch(sys.argv[1], sys.argv[2])
print("REPORT " + json.dumps({"path": r.path, "fetched": r.bytes_fetched, "total": r.bytes_total,
                             "files": r.files, "mb_per_s": r.mb_per_s}))
"""


def fetch(s3_server: Any, uri: str, cache: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", FETCH, uri, str(cache)],
        env={**os.environ, **s3_server.env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("REPORT "))
    return {**json.loads(line[len("REPORT ") :]), "log": out.stderr}


@pytest.fixture(scope="module")
def model(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A fake model folder (random bytes, a nested file, a 24 MB shard) uploaded to the server."""
    src = tmp_path_factory.mktemp("model-src")
    (src / "config.json").write_text('{"model_type": "fake"}')
    (src / "tokenizer").mkdir()
    (src / "tokenizer" / "vocab.json").write_text('{"a": 1}')
    (src / "model-00001-of-00002.safetensors").write_bytes(os.urandom(24 << 20))
    (src / "model-00002-of-00002.safetensors").write_bytes(os.urandom(3 << 20))
    bucket = s3_server.make_bucket("models")
    s3_server.fs().put(str(src) + "/", f"{bucket[5:]}/fake/", recursive=True)
    return f"{bucket}/fake", src


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    mine = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and not p.name.startswith("."))
    return files == mine and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_fetch_once_then_the_marked_cache_is_reused(
    s3_server: Any, model: tuple[str, Path], tmp_path: Path
) -> None:
    uri, src = model
    first = fetch(s3_server, uri, tmp_path)
    total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert first["path"] == str(tmp_path / "s3" / "models" / "fake")
    assert first["files"] == 4 and first["total"] == total and first["fetched"] == total
    assert same_tree(src, Path(first["path"]))
    assert (Path(first["path"]) / ".grpo-complete").exists()
    assert f"{uri}: fetched 4 files" in first["log"] and "MB/s" in first["log"], first["log"]
    print(f"downloaded {total / 1e6:.1f} MB from the test server at {first['mb_per_s']:.1f} MB/s")
    again = fetch(s3_server, uri, tmp_path)
    assert again["fetched"] == 0 and again["path"] == first["path"]
    # a file lost from the cache is fetched again, and only it
    (Path(first["path"]) / "tokenizer" / "vocab.json").unlink()
    healed = fetch(s3_server, uri, tmp_path)
    assert healed["fetched"] == len('{"a": 1}') and same_tree(src, Path(first["path"]))


def test_a_partial_download_continues_where_it_stopped(
    s3_server: Any, model: tuple[str, Path], tmp_path: Path
) -> None:
    uri, src = model
    shard = "model-00001-of-00002.safetensors"
    data = (src / shard).read_bytes()
    dest = tmp_path / "s3" / "models" / "fake"
    dest.mkdir(parents=True)
    etag = s3_server.fs().info(f"models/fake/{shard}")["ETag"]
    kept = 10 << 20
    (dest / f"{shard}.part").write_bytes(data[:kept])  # what a killed download leaves
    (dest / f"{shard}.part.json").write_text(json.dumps({"size": len(data), "etag": etag}))
    report = fetch(s3_server, uri, tmp_path)
    assert report["fetched"] == report["total"] - kept
    assert same_tree(src, dest) and not list(dest.glob("*.part*"))


def test_a_partial_download_of_a_changed_object_starts_over(
    s3_server: Any, model: tuple[str, Path], tmp_path: Path
) -> None:
    uri, src = model
    shard = "model-00002-of-00002.safetensors"
    data = (src / shard).read_bytes()
    dest = tmp_path / "s3" / "models" / "fake"
    dest.mkdir(parents=True)
    (dest / f"{shard}.part").write_bytes(b"x" * 1000)  # from an older version of the object
    (dest / f"{shard}.part.json").write_text(json.dumps({"size": len(data), "etag": '"older"'}))
    report = fetch(s3_server, uri, tmp_path)
    assert report["fetched"] == report["total"] and same_tree(src, dest)


def test_concurrent_processes_of_one_pod_download_once(
    s3_server: Any, model: tuple[str, Path], tmp_path: Path
) -> None:
    uri, src = model
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FETCH, uri, str(tmp_path)],
            env={**os.environ, **s3_server.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        reports.append(json.loads(next(x for x in out.splitlines() if x.startswith("REPORT "))[7:]))
    fetched = sorted(r["fetched"] for r in reports)
    assert fetched == [0, 0, reports[0]["total"]], reports
    assert same_tree(src, Path(reports[0]["path"]))


def test_a_missing_prefix_names_the_uri(s3_server: Any, tmp_path: Path) -> None:
    s3_server.make_bucket("models")
    out = subprocess.run(
        [sys.executable, "-c", FETCH, "s3://models/no-such-model", str(tmp_path)],
        env={**os.environ, **s3_server.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "s3://models/no-such-model: no objects under this prefix" in out.stderr


def test_datasets_stream_from_s3_jsonl_and_parquet(s3_server: Any, tmp_path: Path) -> None:
    """The trainer's load_rows on s3:// objects, in a subprocess with the server's env."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bucket = s3_server.make_bucket("datasets")
    fs = s3_server.fs()
    fs.pipe(
        "datasets/math/train.jsonl",
        b'{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n',
    )
    local = tmp_path / "train.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": f"{i}+0=", "answer": str(i)} for i in range(7)]),
        local,
        row_group_size=3,
    )
    fs.put(str(local), "datasets/pq/train.parquet")
    fs.pipe("datasets/bad/train.jsonl", b'{"prompt": "ok"}\n{"prompt": ""}\n')
    script = "\n".join(
        [
            "import json, sys",
            "from grpo_trainer.data import load_rows",
            "from grpo_trainer.config import ConfigError",
            "try:",
            "    rows = load_rows(sys.argv[1])",
            "except ConfigError as e:",
            "    print('ERROR ' + str(e))",
            "    sys.exit(0)",
            "print(json.dumps([[r.prompt, r.columns, r.line] for r in rows]))",
        ]
    )

    def rows(uri: str) -> Any:
        out = subprocess.run(
            [sys.executable, "-c", script, uri],
            env={**os.environ, **s3_server.env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        line = out.stdout.strip().splitlines()[-1]
        return line if line.startswith("ERROR ") else json.loads(line)

    assert rows(f"{bucket}/math/train.jsonl") == [["1+1=", {"answer": "2"}, 1], ["2+2=", {"answer": "4"}, 3]]
    assert rows(f"{bucket}/pq/train.parquet") == [[f"{i}+0=", {"answer": str(i)}, i + 1] for i in range(7)]
    assert [r[0] for r in rows(f"{bucket}/math")] == ["1+1=", "2+2="]  # a prefix: its data files
    bad = "field 'prompt' missing or not a non-empty string or list of chat messages"
    assert rows(f"{bucket}/bad/train.jsonl") == f"ERROR spec.dataset.path {bucket}/bad/train.jsonl:2: {bad}"
    assert (
        rows(f"{bucket}/nothing-here.jsonl")
        == f"ERROR spec.dataset.path {bucket}/nothing-here.jsonl: does not exist"
    )
