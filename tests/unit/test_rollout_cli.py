"""`python -m grpo_rollout serve` refuses to start, with a clear message, when its inputs are wrong."""

import os
import subprocess
import sys

import pytest
from grpo_rollout.__main__ import listen_host

from tests.support.rollout import write_contract


def serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")}
    return subprocess.run(
        [sys.executable, "-m", "grpo_rollout", "serve", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_contract_and_token_are_named(tmp_path):
    out = serve({})
    assert out.returncode != 0 and "no run contract; set $GRPO_CONTRACT" in out.stderr
    model = tmp_path / "model"
    model.mkdir()
    contract = write_contract(tmp_path / "job.json", model, ports=[18000])
    out = serve({"GRPO_CONTRACT": str(contract)})
    assert out.returncode != 0 and "$GRPO_TOKEN is not set" in out.stderr


@pytest.mark.parametrize(
    "path, message",
    [("pvc://fsx/model", "pvc:// URIs are mounted by the operator"), ("/no/such", "does not exist")],
)
def test_model_path_must_be_a_local_directory(tmp_path, path, message):
    contract = write_contract(tmp_path / "job.json", path, ports=[18000])
    out = serve({"GRPO_CONTRACT": str(contract), "GRPO_TOKEN": "t"})
    assert out.returncode != 0 and message in out.stderr


def test_a_missing_s3_model_is_named(tmp_path, s3_server):
    bucket = s3_server.make_bucket("rollout-cli")
    contract = write_contract(tmp_path / "job.json", f"{bucket}/no-model", ports=[18000])
    out = serve({"GRPO_CONTRACT": str(contract), "GRPO_TOKEN": "t", **s3_server.env})
    assert out.returncode != 0
    assert f"cannot fetch the model '{bucket}/no-model': {bucket}/no-model: no objects" in out.stderr


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1"),
        ("http://[::1]:8000", "::1"),
        ("http://job-rollout-0.job-rollout.ns.svc:8000", "0.0.0.0"),
        ("http://10.0.3.7:8000", "0.0.0.0"),
        (None, "0.0.0.0"),
    ],
)
def test_server_binds_loopback_only_for_a_loopback_endpoint(endpoint: str | None, host: str) -> None:
    assert listen_host(endpoint) == host
