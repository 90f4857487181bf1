"""Real rollout servers for the tests: a tiny model, a run contract, `python -m grpo_rollout serve`.

The model is the product's tiny builder (`grpo_trainer.tiny_model`, random weights: the tests
check mechanics such as batched sampling, log-probs and weight swaps, not quality) at the size
these tests have always used; the servers are child processes on loopback, as in a pod.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from grpo_operator.api.contract import RolloutTopology, RunContract, TrainerTopology
from grpo_operator.api.spec import GRPOJobSpec

from tests.support.ports import free_port

# The rollout tests' model: qwen3_moe with 4 experts (top-2) of width 32 at hidden 64, and 512
# positions, so a prompt plus a 512-token completion (the drain test's long request) fits.
ROLLOUT_MODEL: dict[str, Any] = {"experts": 4, "expert_width": 32, "max_positions": 512}


def build_tiny_model(directory: str | Path, **options: Any) -> Path:
    """Save a tiny random model and the character tokenizer to `directory`: ROLLOUT_MODEL with
    `options`, any `grpo_trainer.tiny_model.TinyConfig` field (`arch="qwen2"`, `tied=True`, `seed`,
    `head_dim=32` where vLLM's CPU attention serves it, bigger sizes)."""
    from grpo_trainer.tiny_model import TinyConfig, save_untrained

    return save_untrained(Path(directory), TinyConfig(**{**ROLLOUT_MODEL, **options}))


def write_contract(
    path: str | Path,
    model_dir: str | Path,
    *,
    ports: list[int],
    rewards: list[dict] | None = None,
    reward_timeout: float = 10.0,
    max_batch_size: int = 64,
    engine: str = "torch",
    vllm: dict | None = None,
    spec_extra: dict | None = None,
) -> Path:
    """A run contract (job.json) for rollout servers on loopback `ports` serving `model_dir`
    with `engine` (`vllm`: the `spec.rollout.vllm` fields in their YAML spelling); `spec_extra`:
    more spec fields (e.g. environment, tools)."""
    spec = GRPOJobSpec.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "dataset": {"path": "/dev/null"},
            "reward": {
                "functions": rewards or [{"builtin": "exact_match"}],
                "timeoutSeconds": reward_timeout,
            },
            "rollout": {
                "engine": engine,
                "replicas": len(ports),
                "maxBatchSize": max_batch_size,
                **({"vllm": vllm} if vllm else {}),
            },
            **(spec_extra or {}),
        }
    )
    contract = RunContract(
        job_name="test",
        namespace="default",
        spec=spec,
        trainer=TrainerTopology(
            service="test-trainer",
            replicas=1,
            processes_per_pod=1,
            world_size=1,
            expert_parallel_size=1,
            data_parallel_size=1,
            master_addr="127.0.0.1",
            master_port=29500,
            backend="gloo",
        ),
        rollout=RolloutTopology(
            service="test-rollout",
            replicas=len(ports),
            port=ports[0],
            endpoints=[f"http://127.0.0.1:{p}" for p in ports],
        ),
        checkpoint_dir="/tmp/unused",
    )
    out = Path(path)
    out.write_text(contract.model_dump_json(by_alias=True))
    return out


def start_server(
    contract: str | Path,
    port: int,
    token: str,
    *,
    drain_seconds: float = 10.0,
    extra_pythonpath: str | None = None,
    log_path: str | Path | None = None,
    python: str | None = None,
    env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start `python -m grpo_rollout serve` as a real child process on 127.0.0.1:port, under
    `python` (default: this interpreter; the vllm tests use the vllm venv's) with `env` added and
    `args` after the command's own."""
    child_env = dict(
        os.environ, GRPO_CONTRACT=str(contract), GRPO_TOKEN=token, HF_HUB_OFFLINE="1", GRPO_POD_INDEX="0"
    )
    child_env.update(env or {})
    if extra_pythonpath:
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (extra_pythonpath, child_env.get("PYTHONPATH")) if p
        )
    cmd = [python or sys.executable, "-m", "grpo_rollout", "serve"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--threads", "1", "--drain-seconds", str(drain_seconds), *args]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    # a session of its own: `stop_server` ends what it forked too (vLLM's engine cores and workers,
    # several GiB, outlived a killed server and starved the rest of the suite)
    return subprocess.Popen(cmd, env=child_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    """Kill a server started by `start_server` and every process it started (its session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Poll GET /health until 200; fail early, with the exit code, if the server process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rollout server {url} exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"rollout server {url} not ready after {timeout}s")


@contextlib.contextmanager
def running_servers(
    model_dir: str | Path, work: Path, token: str, count: int = 2, drain_seconds: float = 3.0
) -> Iterator[tuple[list[str], list[subprocess.Popen]]]:
    """`count` real rollout servers of one contract, ready; (urls, processes). Stopped servers
    (SIGSTOP in a test) are continued before the kill, so none is left behind."""
    ports = [free_port() for _ in range(count)]
    contract = write_contract(work / "servers.json", model_dir, ports=ports, max_batch_size=32)
    logs = {p: work / f"{p}.log" for p in ports}
    procs = [start_server(contract, p, token, drain_seconds=drain_seconds, log_path=logs[p]) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        yield urls, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=30)
