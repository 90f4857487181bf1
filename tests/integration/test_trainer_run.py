"""The trainer gang end to end: `python -m grpo_trainer train` against a real rollout server.

One trainer pod with processesPerPod = 2 and expertParallelSize = 2 (gloo all-to-all between
the two rank processes), one `python -m grpo_rollout serve` child on loopback, the tiny MoE
model built by `python -m grpo_trainer.tiny_model`, and a contract rendered by the operator's
own renderer. Checks: weight versions advance on the server, checkpoints are sealed and
pruned, a resumed gang continues the step count and data position (that run replays the
server's MoE routing: a completion without it would fail the step), a killed rank fails the
pod (restartable), a malformed dataset row fails it permanently with FILE:LINE.
"""

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from grpo_trainer import checkpoint

from tests.support import trainer_run as gang
from tests.support.ports import free_port
from tests.support.trainer_run import (
    assert_exported,
    children,
    finish,
    log_tail,
    progress,
    start_trainer,
    write_contract,
)

pytestmark = pytest.mark.slow
tiny, launch, server = gang.tiny, gang.launch, gang.server  # the harness's fixtures, by name
EXIT_CONFIG = 3


def live_version(url: str) -> int:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
        return json.loads(r.read())["weight_version"]


def test_ep2_gang_pushes_versions_and_resumes_where_it_stopped(server, tiny: Path, tmp_path: Path) -> None:
    port, url = server
    contract = write_contract(tmp_path, tiny, port, maxSteps=4, routingReplay=True, maxStaleness=2)
    assert finish(start_trainer(contract, tmp_path), tmp_path) == 0, log_tail(tmp_path)
    first = progress(tmp_path)
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in first] == [1, 2, 3, 4]
    assert [r["position"] for r in first] == [4, 8, 12, 16]
    # step 1 sync; steps 2 and 3 submitted with it (v0), step 4 after step 2 (v1): two in flight
    assert [r["staleness"] for r in first] == [0, 1, 2, 2]
    assert all(0 <= r["reward_mean"] <= 1 and r["samples"] == 16 for r in first)
    assert live_version(url) == 4
    saves = sorted(p.name for p in (tmp_path / "ckpt" / "local" / "t").iterdir())
    assert saves == ["final", "step-00000004"]  # keepLast 1 pruned step 2, no .tmp left behind

    contract = write_contract(tmp_path, tiny, port, maxSteps=6, routingReplay=True)  # same checkpoint dir
    assert finish(start_trainer(contract, tmp_path), tmp_path) == 0, log_tail(tmp_path)
    resumed = progress(tmp_path)[len(first) :]
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["position"] for r in resumed] == [20, 24]  # continues at prompt 16: none skipped or repeated
    # the resumed gang re-sent its policy as version 5 (servers may hold newer weights than the save)
    assert [r["weight_version"] for r in resumed] == [6, 7]
    assert live_version(url) == 7
    assert_exported(tmp_path / "ckpt" / "local" / "t" / "final", tiny)


def test_full_sharding_gang_pushes_saves_exports_and_resumes(server, tiny: Path, tmp_path: Path) -> None:
    """trainer.sharding full end to end: FSDP2 dense DTensors, weight sync gathering them one at a
    time, DCP saves with DTensor state, an HF export with every expert, and a resume."""
    port, url = server
    full = {"sharding": "full"}
    contract = write_contract(tmp_path, tiny, port, trainer=full, maxSteps=2, klCoef=0.05, routingReplay=True)
    assert finish(start_trainer(contract, tmp_path), tmp_path) == 0, log_tail(tmp_path)
    assert [r["weight_version"] for r in progress(tmp_path)] == [1, 2]
    assert live_version(url) == 2
    contract = write_contract(tmp_path, tiny, port, trainer=full, maxSteps=3, klCoef=0.05, routingReplay=True)
    assert finish(start_trainer(contract, tmp_path), tmp_path) == 0, log_tail(tmp_path)
    assert [r["step"] for r in progress(tmp_path)] == [1, 2, 3]
    assert "resum" in (tmp_path / "trainer.log").read_text().lower()
    assert_exported(tmp_path / "ckpt" / "local" / "t" / "final", tiny)


def test_killed_rank_fails_the_pod_and_the_gang_restarts_from_the_checkpoint(
    server, tiny: Path, tmp_path: Path
) -> None:
    port, _ = server
    contract = write_contract(tmp_path, tiny, port, maxSteps=400)
    proc = start_trainer(contract, tmp_path)
    deadline = time.monotonic() + 180
    while not any(r["step"] >= 3 for r in progress(tmp_path)):
        assert time.monotonic() < deadline and proc.poll() is None, log_tail(tmp_path)
        time.sleep(0.2)
    ranks = children(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    code = finish(proc, tmp_path, timeout=120)
    assert code not in (0, EXIT_CONFIG)  # a restartable failure
    assert not any(Path(f"/proc/{r}").exists() for r in ranks)  # the launcher stopped and reaped both
    saved = max(checkpoint.list_saves(str(tmp_path / "ckpt" / "local" / "t"))[0])
    before = len(progress(tmp_path))

    contract = write_contract(tmp_path, tiny, port, maxSteps=saved + 2)
    assert finish(start_trainer(contract, tmp_path), tmp_path) == 0
    assert [r["step"] for r in progress(tmp_path)[before:]] == [saved + 1, saved + 2]


def test_malformed_dataset_row_is_a_permanent_error_naming_file_and_line(tiny: Path, tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n{"prompt": 3}\n')
    contract = write_contract(tmp_path, tiny, free_port(), dataset=str(data))
    assert finish(start_trainer(contract, tmp_path), tmp_path, timeout=120) == EXIT_CONFIG
    assert (
        f"{data}:3: field 'prompt' missing or not a non-empty string"
        in (tmp_path / "trainer.log").read_text()
    )


def wait_for_step(proc: subprocess.Popen, work: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in progress(work)):
        assert time.monotonic() < deadline and proc.poll() is None, log_tail(work)
        time.sleep(0.2)


def test_lost_rollout_server_is_routed_around_and_catches_up_when_back(
    launch, tiny: Path, tmp_path: Path
) -> None:
    ports = (free_port(), free_port())
    launch(ports[0])
    second = launch(ports[1])
    contract = write_contract(tmp_path, tiny, ports, maxSteps=200, maxStaleness=0)
    proc = start_trainer(contract, tmp_path)
    wait_for_step(proc, tmp_path, 3)
    second.kill()  # a Spot interruption without a drain: requests in flight fail
    second.wait()
    reached = max(r["step"] for r in progress(tmp_path))
    wait_for_step(proc, tmp_path, reached + 5)  # training goes on with one server
    launch(ports[1])  # the replacement pod starts from the model on disk, version 0
    assert proc.poll() is None, "training ended before the replacement server was up: raise maxSteps"
    assert finish(proc, tmp_path) == 0, log_tail(tmp_path)
    steps = [r["step"] for r in progress(tmp_path)]
    assert steps == list(range(1, 201))
    assert live_version(f"http://127.0.0.1:{ports[1]}") == 200  # brought up to date by the trainer


def test_two_pods_of_one_rank_form_one_gang(server, tiny: Path, tmp_path: Path) -> None:
    port, url = server
    contract = write_contract(tmp_path, tiny, port, pods=2, maxSteps=3)
    pods = [start_trainer(contract, tmp_path, pod) for pod in (0, 1)]
    assert [finish(p, tmp_path) for p in pods] == [0, 0], log_tail(tmp_path)
    assert [r["step"] for r in progress(tmp_path)] == [1, 2, 3]  # pod 1's rank is not rank 0: no lines
    assert live_version(url) == 3


def test_sigterm_saves_the_current_step_and_a_restart_continues_from_it(
    server, tiny: Path, tmp_path: Path
) -> None:
    port, _ = server
    contract = write_contract(tmp_path, tiny, port, maxSteps=400, checkpoint_every=1000)
    proc = start_trainer(contract, tmp_path)
    wait_for_step(proc, tmp_path, 3)
    proc.send_signal(signal.SIGTERM)  # what the kubelet sends on pod deletion, suspend or preemption
    assert finish(proc, tmp_path, timeout=120) == 143
    last = progress(tmp_path)[-1]["step"]
    assert 3 <= last < 400
    assert checkpoint.list_saves(str(tmp_path / "ckpt" / "local" / "t")) == (
        [last],
        [],
    )  # no periodic save ran
    contract = write_contract(tmp_path, tiny, port, maxSteps=last + 1, checkpoint_every=1000)
    assert finish(start_trainer(contract, tmp_path), tmp_path) == 0, log_tail(tmp_path)
    assert progress(tmp_path)[-1]["step"] == last + 1 and progress(tmp_path)[-2]["step"] == last


def test_trainer_started_before_its_rollout_server_waits_for_it(launch, tiny: Path, tmp_path: Path) -> None:
    port = free_port()
    contract = write_contract(tmp_path, tiny, port, maxSteps=2)
    proc = start_trainer(contract, tmp_path)  # as in a cluster where trainer pods schedule first
    time.sleep(5)
    assert proc.poll() is None
    launch(port)
    assert finish(proc, tmp_path) == 0, log_tail(tmp_path)
    assert [r["step"] for r in progress(tmp_path)] == [1, 2]
