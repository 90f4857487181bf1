"""`python -m grpo_trainer train`: the per-pod launcher of the trainer gang.

The container command of every trainer pod (rendered by the operator, run as a process by the
local runtime). Reads the run contract and GRPO_POD_INDEX, starts `processesPerPod` rank
processes (`python -m grpo_trainer rank`) with RANK = podIndex x processesPerPod + localRank,
and waits. If one rank fails the others are stopped and the pod exits with that rank's code:
the gang is restarted as a whole (NCCL cannot heal a lost peer). `EXIT_CONFIG` (3) from any
rank means a permanent error and is passed through so nobody retries. SIGTERM is forwarded.
"""

import os
import signal
import subprocess
import sys
import time
from types import FrameType

from grpo_operator.api.contract import ENV_POD_INDEX, EXIT_CONFIG, RunContract

from grpo_trainer.config import ConfigError, load_contract

POLL_S = 0.2
STOP_GRACE_S = 20.0


def rank_env(contract: RunContract, pod_index: int, local_rank: int) -> dict[str, str]:
    topo = contract.trainer
    rank = pod_index * topo.processes_per_pod + local_rank
    threads = max(1, (os.cpu_count() or 1) // topo.processes_per_pod)  # no oversubscription (as torchrun)
    return {
        "OMP_NUM_THREADS": str(threads),
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(topo.processes_per_pod),
        "WORLD_SIZE": str(topo.world_size),
        "MASTER_ADDR": topo.master_addr,
        "MASTER_PORT": str(topo.master_port),
        ENV_POD_INDEX: str(pod_index),
    }


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def supervise(procs: list[subprocess.Popen], first_rank: int) -> int:
    """Wait for every rank; on the first failure stop the rest and return its exit code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            print(
                f"grpo-trainer: rank {first_rank + i} exited with code {code}; stopping the pod",
                file=sys.stderr,
            )
            _stop(procs)
            codes = [p.returncode for p in procs]
            return EXIT_CONFIG if EXIT_CONFIG in codes else (code if code > 0 else 1)
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)


def main() -> int:
    try:
        contract = load_contract()
        pod_index = int(os.environ.get(ENV_POD_INDEX, "0"))
    except (ConfigError, ValueError) as e:
        print(f"grpo-trainer: {e}", file=sys.stderr)
        return EXIT_CONFIG
    n = contract.trainer.processes_per_pod
    procs = [
        subprocess.Popen([sys.executable, "-m", "grpo_trainer", "rank"], env=rank_env(contract, pod_index, r))
        for r in range(n)
    ]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return supervise(procs, pod_index * n)
