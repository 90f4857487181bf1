"""The per-pod launcher: rank numbering, contract errors, and failing the pod when one rank fails."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from grpo_operator import render
from grpo_operator.api.contract import EXIT_CONFIG
from grpo_operator.api.job import GRPOJob
from grpo_trainer.config import ConfigError, RankInfo, load_contract
from grpo_trainer.launcher import rank_env, supervise


def contract(replicas: int = 2, per_pod: int = 4, ep: int = 2):
    job = GRPOJob.model_validate(
        {
            "apiVersion": "grpo.dev/v1alpha1",
            "kind": "GRPOJob",
            "metadata": {"name": "j"},
            "spec": {
                "model": {"path": "/m"},
                "dataset": {"path": "/d.jsonl"},
                "reward": {"functions": [{"builtin": "math"}]},
                "trainer": {"replicas": replicas, "processesPerPod": per_pod, "expertParallelSize": ep},
            },
        }
    )
    ports = render.LocalPorts(trainer_master_port=29500, rollout_ports=(8000,))
    return render.contract(job, name="j", namespace="ns", local_ports=ports)


def test_rank_env_numbers_ranks_pod_major() -> None:
    env = rank_env(contract(), pod_index=1, local_rank=2)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("6", "2", "8")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29500")
    info = RankInfo.from_env(contract(), env)
    assert (info.rank, info.ep_rank, info.pod_index) == (6, 0, 1)


def test_rank_info_rejects_a_world_size_the_contract_does_not_have() -> None:
    with pytest.raises(ConfigError, match="WORLD_SIZE=4 but the contract says 8"):
        RankInfo.from_env(contract(), {"RANK": "0", "WORLD_SIZE": "4"})


def test_load_contract_from_file_or_inline_json(tmp_path: Path) -> None:
    text = contract().model_dump_json(by_alias=True)
    (tmp_path / "job.json").write_text(text)
    assert load_contract({"GRPO_CONTRACT": str(tmp_path / "job.json")}).job_name == "j"
    assert load_contract({"GRPO_CONTRACT": text}).trainer.world_size == 8
    with pytest.raises(ConfigError, match="GRPO_CONTRACT is not set"):
        load_contract({})
    with pytest.raises(ConfigError, match="cannot read the run contract"):
        load_contract({"GRPO_CONTRACT": str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError, match="invalid run contract"):
        load_contract({"GRPO_CONTRACT": '{"jobName": 1}'})


def py(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_one_failed_rank_stops_the_others_and_fails_the_pod() -> None:
    procs = [py("import time; time.sleep(60)"), py("import sys; sys.exit(7)")]
    start = time.monotonic()
    assert supervise(procs, first_rank=0) == 7
    assert time.monotonic() - start < 30
    assert procs[0].returncode is not None  # the sleeper was stopped, not left behind


def test_a_config_error_anywhere_wins_so_nobody_retries() -> None:
    procs = [py("import sys, time; time.sleep(0.5); sys.exit(1)"), py(f"import sys; sys.exit({EXIT_CONFIG})")]
    assert supervise(procs, first_rank=0) == EXIT_CONFIG


def test_all_ranks_succeeding_is_success() -> None:
    assert supervise([py("pass"), py("pass")], first_rank=0) == 0
