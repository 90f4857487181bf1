"""spec.storage rendered: the model cache emptyDir and the AWS_* env, on both roles; offline CEL."""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpo_operator.api.job import GRPOJob
from grpo_operator.local.plan import PlanError, localize
from grpo_operator.render import render
from grpo_operator.validation import validate_text

BASE: dict[str, Any] = {
    "apiVersion": "grpo.dev/v1alpha1",
    "kind": "GRPOJob",
    "metadata": {"name": "st"},
    "spec": {
        "model": {"path": "s3://models/qwen3"},
        "dataset": {"path": "s3://data/train.parquet"},
        "reward": {"functions": [{"builtin": "exact_match"}]},
    },
}


def pods(storage: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    job = {**BASE, "spec": {**BASE["spec"], **({"storage": storage} if storage else {})}}
    out = render(GRPOJob.model_validate(job), name="st", namespace="ml", uid="uid-1")
    return {
        c["metadata"]["name"].removeprefix("st-"): c["spec"]["template"]["spec"]
        for c in out.children
        if c["kind"] == "StatefulSet"
    }


def test_every_pod_gets_a_disk_backed_model_cache_and_no_keys_by_default() -> None:
    for role, spec in pods().items():
        (cache,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
        assert cache == {"name": "model-cache", "emptyDir": {}}, role  # disk, not medium: Memory
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["model-cache"] == "/var/cache/grpo"
        env = {e["name"] for e in spec["containers"][0]["env"]}
        assert not {e for e in env if e.startswith("AWS_")}, "Pod Identity / IRSA supply credentials"


def test_an_s3_compatible_store_gets_endpoint_region_and_secret_env_on_both_roles() -> None:
    storage = {
        "endpointUrl": "https://minio.storage:9000",
        "region": "eu-west-1",
        "credentialsSecret": "team-s3",
        "cacheDir": "/scratch/models",
        "cacheSizeLimit": "200Gi",
    }
    for role, spec in pods(storage).items():
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["AWS_ENDPOINT_URL"]["value"] == "https://minio.storage:9000", role
        assert env["AWS_REGION"]["value"] == "eu-west-1"
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key]["valueFrom"] == {"secretKeyRef": {"name": "team-s3", "key": key}}
        (cache,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
        assert cache["emptyDir"] == {"sizeLimit": "200Gi"}
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert mounts["model-cache"] == "/scratch/models"


@pytest.mark.parametrize(
    ("storage", "field"),
    [
        ({"cacheDir": "/dev/shm/models"}, "storage.cacheDir must not be /dev/shm"),
        ({"cacheDir": "relative/dir"}, "spec.storage.cacheDir"),
        ({"endpointUrl": "minio:9000"}, "spec.storage.endpointUrl"),
        ({"credentialsSecret": "Not_A_Name"}, "spec.storage.credentialsSecret"),
        ({"cacheSizeLimit": "lots"}, "spec.storage.cacheSizeLimit"),
    ],
)
def test_validate_refuses_bad_storage_fields(storage: dict[str, Any], field: str) -> None:
    job = {**BASE, "spec": {**BASE["spec"], "storage": storage}}
    problems = validate_text(yaml.safe_dump(job), "job.yaml")
    assert any(field in str(p) for p in problems), problems


def test_local_runtime_keeps_s3_maps_pvc_claims_and_caches_in_the_workdir(tmp_path: Path) -> None:
    claim = tmp_path / "fsx"
    (claim / "tiny").mkdir(parents=True)
    (claim / "tiny" / "data.jsonl").write_text("{}")
    job = GRPOJob.model_validate(
        {
            **BASE,
            "spec": {
                **BASE["spec"],
                "dataset": {"path": "pvc://fsx/tiny/data.jsonl"},
                "checkpoint": {"path": "pvc://fsx/ckpt"},
                "model": {"path": "pvc://fsx/tiny"},
            },
        }
    )
    local = localize(job, base=tmp_path, workdir=tmp_path / "work", pvc={"fsx": claim})
    assert local.spec.model.path == str(claim / "tiny")
    assert local.spec.dataset.path == str(claim / "tiny" / "data.jsonl")
    assert local.spec.checkpoint.path == str(claim / "ckpt")
    assert local.spec.storage.cache_dir == str(tmp_path / "work" / "cache")
    with pytest.raises(PlanError, match=r"claim 'fsx' has no local folder; pass --pvc fsx=DIR"):
        localize(job, base=tmp_path, workdir=tmp_path / "work")


def test_a_held_out_set_on_a_claim_is_mounted_on_the_trainer_resolved_and_localized(tmp_path: Path) -> None:
    spec = {
        **BASE["spec"],
        "dataset": {**BASE["spec"]["dataset"], "eval": {"path": "pvc://evals/gsm8k/test"}},
    }
    job = GRPOJob.model_validate({**BASE, "spec": spec})
    out = render(job, name="st", namespace="ml", uid="uid-1")
    (trainer,) = [
        c for c in out.children if c["metadata"]["name"] == "st-trainer" and c["kind"] == "StatefulSet"
    ]
    mounts = trainer["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "pvc-evals", "mountPath": "/mnt/pvc/evals"} in mounts
    (configmap,) = [c for c in out.children if c["kind"] == "ConfigMap"]
    contract = json.loads(next(iter(configmap["data"].values())))
    assert contract["spec"]["dataset"]["eval"]["path"] == "/mnt/pvc/evals/gsm8k/test"
    assert contract["spec"]["dataset"]["path"] == "s3://data/train.parquet"
    (tmp_path / "claim" / "gsm8k" / "test").mkdir(parents=True)
    (tmp_path / "m").mkdir()
    (tmp_path / "d.jsonl").write_text("{}")
    spec = {**spec, "model": {"path": "./m"}, "dataset": {**spec["dataset"], "path": "./d.jsonl"}}
    local = localize(
        GRPOJob.model_validate({**BASE, "spec": spec}),
        base=tmp_path,
        workdir=tmp_path / "w",
        pvc={"evals": tmp_path / "claim"},
    )
    assert local.spec.dataset.eval is not None
    assert local.spec.dataset.eval.path == str(tmp_path / "claim" / "gsm8k" / "test")
