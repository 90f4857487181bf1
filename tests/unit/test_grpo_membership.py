"""The rollout membership sources the trainer follows: the run contract file (real files here) and
the choice between it and the EndpointSlices (their own test needs an API server:
tests/e2e/test_rollout_discovery.py); the local runtime's rescaling helpers.
"""

import logging
import os
from pathlib import Path

import pytest
from grpo_operator import render
from grpo_operator.api.contract import ENV_CONTRACT, ENV_POD_INDEX, RunContract
from grpo_operator.local import scaling
from grpo_operator.local.procs import PodCommand
from grpo_trainer import membership

from tests.support.render import job


def contract(ports: list[int]) -> RunContract:
    spec = job(rollout__replicas=len(ports))
    local = render.LocalPorts(trainer_master_port=1234, rollout_ports=tuple(ports))
    return render.contract(spec, name="moe", namespace="local", uid="u", local_ports=local)


def urls(ports: list[int]) -> list[str]:
    return [f"http://127.0.0.1:{p}" for p in ports]


def test_contract_file_source_follows_rewrites_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    base = contract([8001, 8002])
    scaling.write_contract(path, base)
    source = membership.ContractFileSource(path)
    assert source.read() == urls([8001, 8002])
    scaling.write_contract(path, scaling.with_endpoints(base, urls([8001, 8002, 8003])))
    assert source.read() == urls([8001, 8002, 8003])
    scaling.write_contract(path, scaling.with_endpoints(base, urls([8002])))
    assert source.read() == urls([8002])
    assert [p.name for p in tmp_path.iterdir()] == ["job.json"]  # the temporary file was renamed


def test_a_kubelet_style_symlink_swap_is_followed(tmp_path: Path) -> None:
    """A ConfigMap volume: job.json -> ..data/job.json, ..data -> a timestamped folder swapped whole."""
    for name, ports in (("v1", [8001]), ("v2", [8001, 8002])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.json").write_text(contract(ports).model_dump_json(by_alias=True))
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "job.json").symlink_to("..data/job.json")
    source = membership.ContractFileSource(tmp_path / "job.json")
    assert source.read() == urls([8001])
    (tmp_path / "..data_tmp").symlink_to("v2")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert source.read() == urls([8001, 8002])


def test_follower_keeps_the_last_set_and_logs_an_outage_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "job.json"
    scaling.write_contract(path, contract([8001, 8002]))
    follower = membership.Follower(membership.ContractFileSource(path), [])
    assert follower.poll() == urls([8001, 8002])
    caplog.set_level(logging.INFO, logger=membership.__name__)
    path.write_text("{ half a file")
    assert follower.poll() == urls([8001, 8002])
    path.unlink()
    assert follower.poll() == urls([8001, 8002])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "keeping 2 known" in warnings[0].getMessage()
    scaling.write_contract(path, contract([8003]))
    assert follower.poll() == urls([8003])
    assert "works again" in caplog.records[-1].getMessage()


def test_outside_a_cluster_the_contract_file_is_followed(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    run = contract([8001])
    scaling.write_contract(path, run)
    source = membership.choose_source(run, env={ENV_CONTRACT: str(path)})
    assert isinstance(source, membership.ContractFileSource) and source.path == path
    # The contract given inline (its JSON in the variable): nothing to re-read.
    assert membership.choose_source(run, env={ENV_CONTRACT: path.read_text()}) is None


def test_in_a_cluster_without_an_api_the_contract_file_is_followed(tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    run = contract([8001])
    scaling.write_contract(path, run)
    # KUBERNETES_SERVICE_HOST set but no ServiceAccount token mounted here: the client cannot load.
    env = {ENV_CONTRACT: str(path), "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1"}
    assert isinstance(membership.choose_source(run, env=env), membership.ContractFileSource)


def test_job_file_watch_reports_replica_edits_and_ignores_bad_ones(tmp_path: Path) -> None:
    import yaml

    from tests.support.render import BASE

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(BASE))
    watch = scaling.JobFileWatch(path, replicas=job().spec.rollout.replicas)
    assert watch.poll() == (None, None)
    edited = {**BASE, "spec": {**BASE["spec"], "rollout": {**BASE["spec"]["rollout"], "replicas": 3}}}
    path.write_text(yaml.safe_dump(edited) + "\n")
    assert watch.poll() == (3, None)
    assert watch.poll() == (None, None)
    path.write_text("kind: GRPOJob\nspec: [not, a, mapping]\n")
    replicas, why = watch.poll()
    assert replicas is None and why and "ignored" in why


def test_rollout_pod_is_pod_zero_with_its_own_index(tmp_path: Path) -> None:
    env = {ENV_CONTRACT: str(tmp_path / "job.json"), ENV_POD_INDEX: "0", "X": "1"}
    template = PodCommand("rollout", 0, ["python", "-m", "grpo_rollout", "serve"], env, tmp_path, 7.0)
    pod = scaling.rollout_pod(template, 4)
    assert pod.name == "rollout-4" and pod.env[ENV_POD_INDEX] == "4" and pod.env["X"] == "1"
    assert pod.argv == template.argv and pod.grace_s == 7.0 and template.env[ENV_POD_INDEX] == "0"
    assert scaling.contract_path(template) == tmp_path / "job.json"
