"""spec.tracking as the pods see it: the backend's credentials as secretKeyRef env on the trainer
container only, a TensorBoard folder on a claim mounted and resolved in the contract, the local
runtime's paths made absolute, and the CEL rules that refuse a backend without what it needs."""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator.api.job import GRPOJob
from grpo_operator.local.plan import localize
from grpo_operator.render import render
from grpo_operator.validation import validate_text

BASE: dict[str, Any] = {
    "apiVersion": "grpo.dev/v1alpha1",
    "kind": "GRPOJob",
    "metadata": {"name": "tr"},
    "spec": {
        "model": {"path": "s3://models/qwen3"},
        "dataset": {"path": "s3://data/train.parquet"},
        "reward": {"functions": [{"builtin": "exact_match"}]},
    },
}


def job(tracking: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, "spec": {**BASE["spec"], "tracking": tracking}}


def rendered(tracking: dict[str, Any]):
    return render(GRPOJob.model_validate(job(tracking)), name="tr", namespace="ml", uid="uid-1")


def pod_spec(r, role: str) -> dict[str, Any]:
    (sts,) = [c for c in r.children if c["kind"] == "StatefulSet" and c["metadata"]["name"] == f"tr-{role}"]
    return sts["spec"]["template"]["spec"]


def secret_env(r, role: str) -> dict[str, dict]:
    env = pod_spec(r, role)["containers"][0]["env"]
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "secretKeyRef" in e.get("valueFrom", {})
    }


def test_mlflow_credentials_reach_the_trainer_only_each_key_optional() -> None:
    r = rendered(
        {"backend": "mlflow", "uri": "https://mlflow.example.com", "credentialsSecret": "mlflow-creds"}
    )
    tracking = {k: v for k, v in secret_env(r, "trainer").items() if k.startswith("MLFLOW_")}
    assert tracking == {
        key: {"name": "mlflow-creds", "key": key, "optional": True}
        for key in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    }
    assert not [k for k in secret_env(r, "rollout") if k.startswith("MLFLOW_")]


def test_wandb_needs_its_api_key_and_tracking_without_a_secret_adds_no_env() -> None:
    r = rendered({"backend": "wandb", "credentialsSecret": "wandb-key"})
    assert secret_env(r, "trainer")["WANDB_API_KEY"] == {"name": "wandb-key", "key": "WANDB_API_KEY"}
    plain = rendered({"backend": "mlflow", "uri": "http://mlflow.tracking:5000"})
    assert secret_env(plain, "trainer") == secret_env(rendered({"backend": "wandb"}), "trainer")
    assert not [k for k in secret_env(plain, "trainer") if k.startswith(("MLFLOW_", "WANDB_"))]


def test_a_tensorboard_folder_on_a_claim_is_mounted_and_resolved_in_the_contract() -> None:
    r = rendered({"backend": "tensorboard", "uri": "pvc://runs/tb"})
    mounts = pod_spec(r, "trainer")["containers"][0]["volumeMounts"]
    assert {"name": "pvc-runs", "mountPath": "/mnt/pvc/runs"} in mounts
    assert not [m for m in pod_spec(r, "rollout")["containers"][0]["volumeMounts"] if m["name"] == "pvc-runs"]
    (configmap,) = [c for c in r.children if c["kind"] == "ConfigMap"]
    contract = json.loads(next(iter(configmap["data"].values())))
    assert contract["spec"]["tracking"] == {"backend": "tensorboard", "uri": "/mnt/pvc/runs/tb"}


def test_the_local_runtime_makes_a_tensorboard_folder_absolute_and_keeps_urls(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text("{}")

    def local(tracking: dict[str, Any]) -> GRPOJob:
        spec = {
            **BASE["spec"],
            "model": {"path": "./m"},
            "dataset": {"path": "./d.jsonl"},
            "tracking": tracking,
        }
        j = GRPOJob.model_validate({**BASE, "spec": spec})
        return localize(j, base=tmp_path, workdir=tmp_path / "w", pvc={"runs": tmp_path / "claim"})

    tb = local({"backend": "tensorboard", "uri": "pvc://runs/tb"}).spec.tracking
    assert tb is not None and tb.uri == str(tmp_path / "claim" / "tb")
    mlflow = local({"backend": "mlflow", "uri": "http://127.0.0.1:5000"}).spec.tracking
    assert mlflow is not None and mlflow.uri == "http://127.0.0.1:5000"


@pytest.mark.parametrize(
    ("tracking", "message"),
    [
        ({"backend": "mlflow"}, "mlflow needs the tracking server's http(s):// URL"),
        ({"backend": "mlflow", "uri": "/runs"}, "mlflow needs the tracking server's http(s):// URL"),
        ({"backend": "tensorboard"}, "tensorboard needs the event files' directory"),
        ({"backend": "tensorboard", "uri": "http://tb:6006"}, "tensorboard needs the event files' directory"),
        (
            {"backend": "tensorboard", "uri": "/runs", "credentialsSecret": "s"},
            "tensorboard writes files and reads no credentials",
        ),
        ({"backend": "neptune", "uri": "http://n"}, "tracking.backend"),
        ({"backend": "wandb", "uri": "ftp://w"}, "tracking.uri"),
    ],
)
def test_validate_refuses_a_backend_without_what_it_needs(tracking: dict[str, Any], message: str) -> None:
    problems = validate_text(yaml.safe_dump(job(tracking)), "job.yaml")
    assert any(message in str(p) for p in problems), problems


@pytest.mark.parametrize(
    "tracking",
    [
        {"backend": "mlflow", "uri": "http://mlflow.tracking:5000", "experiment": "team/grpo"},
        {"backend": "tensorboard", "uri": "pvc://runs/tb"},
        {"backend": "wandb"},
        {"backend": "wandb", "uri": "https://wandb.example.com", "credentialsSecret": "wandb-key"},
    ],
)
def test_validate_accepts_each_backend(tracking: dict[str, Any]) -> None:
    assert validate_text(yaml.safe_dump(job(tracking)), "job.yaml") == []
