"""A trainer gang against a real rollout server, as the trainer-run and checkpoint tests start them:
the demo's tiny model (`python -m grpo_trainer.tiny_model`), a contract rendered by the operator's
renderer, `python -m grpo_trainer train` processes, and what they leave behind (progress, saves).

`tiny` (module), `launch` and `server` are fixtures, shared by name with the modules that bind them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from grpo_operator import render
from grpo_operator.api.job import GRPOJob

from tests.support.ports import free_port
from tests.support.rollout import start_server, wait_ready

TOKEN = "trainer-test-token"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    cmd = [sys.executable, "-m", "grpo_trainer.tiny_model", str(out)]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    return out


def write_contract(
    work: Path,
    tiny: Path,
    rollout_port: int | tuple[int, ...],
    pods: int = 1,
    checkpoint_every: int = 2,
    trainer: dict | None = None,
    reward: dict | None = None,
    reward_ports: tuple[int, ...] = (),
    **algorithm: object,
) -> Path:
    """Render the contract for an EP = 2 job of 2 ranks (1 pod x 2, or 2 pods x 1) and the given
    rollout server port(s); `reward` replaces spec.reward (its YAML spelling), its model served on
    `reward_ports`."""
    rollout_ports = rollout_port if isinstance(rollout_port, tuple) else (rollout_port,)
    spec = {
        "model": {"path": str(tiny), "dtype": "float32"},
        "dataset": {"path": algorithm.pop("dataset", str(tiny / "addition.jsonl"))},
        "reward": reward or {"functions": [{"builtin": "exact_match"}]},
        "algorithm": {"groupSize": 4, "promptsPerStep": 4, "microBatchSize": 4, "maxNewTokens": 4,
                      "learningRate": 1e-3, "maxStaleness": 1, **algorithm},
        "trainer": {"replicas": pods, "processesPerPod": 2 // pods, "expertParallelSize": 2,
                    "epBackend": "gloo", **(trainer or {})},
        "rollout": {"replicas": len(rollout_ports), "engine": "torch"},
        "checkpoint": {"path": str(work / "ckpt"), "everySteps": checkpoint_every, "keepLast": 1},
    }  # fmt: skip
    job = GRPOJob.model_validate({"apiVersion": "grpo.dev/v1alpha1", "kind": "GRPOJob",
                                  "metadata": {"name": "t"}, "spec": spec})  # fmt: skip
    ports = render.LocalPorts(
        trainer_master_port=free_port(), rollout_ports=rollout_ports, reward_ports=reward_ports
    )
    contract = render.contract(job, name="t", namespace="local", local_ports=ports)
    path = work / "job.json"
    path.write_text(contract.model_dump_json(by_alias=True))
    return path


@pytest.fixture
def launch(tiny: Path, tmp_path: Path):
    """Start a rollout server on a port (its contract only needs the model path and the port);
    every server started is killed at the end of the test."""
    procs: list[subprocess.Popen] = []

    def _launch(port: int) -> subprocess.Popen:
        work = tmp_path / f"server-{port}"
        work.mkdir(exist_ok=True)
        proc = start_server(write_contract(work, tiny, port), port, TOKEN, log_path=work / "rollout.log")
        procs.append(proc)
        wait_ready(f"http://127.0.0.1:{port}", proc)
        return proc

    yield _launch
    for proc in procs:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def server(launch) -> tuple[int, str]:
    port = free_port()
    launch(port)
    return port, f"http://127.0.0.1:{port}"


def start_trainer(contract: Path, work: Path, pod: int = 0) -> subprocess.Popen:
    env = {**os.environ, "GRPO_CONTRACT": str(contract), "GRPO_POD_INDEX": str(pod), "GRPO_TOKEN": TOKEN}
    env.update(GRPO_PROGRESS_FILE=str(work / "progress.jsonl"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    log = open(work / ("trainer.log" if pod == 0 else f"trainer-{pod}.log"), "ab")  # noqa: SIM115 - the child's
    return subprocess.Popen([sys.executable, "-m", "grpo_trainer", "train"], env=env, stdout=log, stderr=log)


def log_tail(work: Path) -> str:
    return (work / "trainer.log").read_text()[-3000:]


def finish(proc: subprocess.Popen, work: Path, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"trainer did not finish in {timeout}s:\n{log_tail(work)}")


def records(work: Path) -> list[dict]:
    path = work / "progress.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def progress(work: Path) -> list[dict]:
    """The step reports (attempt-start records left out)."""
    return [r for r in records(work) if not r.get("attempt_start")]


def attempt_starts(work: Path) -> list[dict]:
    """Where each attempt started, in order."""
    return [r for r in records(work) if r.get("attempt_start")]


def assert_exported(final: Path, tiny: Path) -> None:
    """The trained policy is a loadable HF model with every expert, and it moved from the start."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    start = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    assert AutoTokenizer.from_pretrained(final, local_files_only=True)("3+4=").input_ids
    a, b = trained.state_dict(), start.state_dict()
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert any(not torch.equal(a[k], b[k]) for k in a if ".experts." in k)


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]
