"""`grpo-operator preview` of a job whose model and dataset are on S3 (a real S3-compatible server,
moto's): the rows are streamed, only the tokenizer's small files are fetched, never the weights."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from grpo_trainer.tiny_model import TinyConfig, save_untrained


def test_preview_reads_an_s3_dataset_through_an_s3_models_template(s3_server: Any, tmp_path: Path) -> None:
    src = save_untrained(tmp_path / "model", TinyConfig())
    (src / "model-00002-of-00002.safetensors").write_bytes(
        b"\0" * (8 << 20)
    )  # would be fetched if weights were
    bucket = s3_server.make_bucket("preview")
    fs = s3_server.fs()
    fs.put(str(src) + "/", f"{bucket[5:]}/tiny/", recursive=True)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fs.put(str(tmp_path / "train.jsonl"), f"{bucket[5:]}/data/train.jsonl")
    manifest = {
        "apiVersion": "grpo.dev/v1alpha1",
        "kind": "GRPOJob",
        "metadata": {"name": "s3-preview"},
        "spec": {
            "model": {"path": f"{bucket}/tiny"},
            "dataset": {"path": f"{bucket}/data/train.jsonl"},
            "reward": {"functions": [{"builtin": "exact_match"}]},
        },
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest))
    cmd = [sys.executable, "-m", "grpo_operator.cli", "preview", str(job), "-n", "2", "--json"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **s3_server.env}
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["prompts"][1]["text"] == "<|user|>1+1=<|end|><|assistant|>"
    assert report["prompts"][1]["row"] == f"{bucket}/data/train.jsonl:2"
    assert report["lengths"]["prompts"] == 5
