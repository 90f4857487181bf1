"""Rollout replicas changed during a local run, as `kubectl scale grpo/NAME` changes them in a cluster.

Used by `grpo_operator.local.supervisor`. A cluster user scales rollout by editing the job
(`spec.rollout.replicas`); the operator then moves the StatefulSet and re-renders the run contract's
`rollout.endpoints`, which the trainer follows. Locally the same edit of the job file does the
same: `JobFileWatch` notices it (the edit is validated as the API server would; a bad edit is
reported and ignored), the supervisor starts or stops rollout processes (highest index first, as
a StatefulSet does) and `write_contract` rewrites the contract file the trainer re-reads.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from grpo_operator.api.contract import ENV_CONTRACT, ENV_POD_INDEX, RunContract
from grpo_operator.local.plan import PlanError, load_job
from grpo_operator.local.procs import PodCommand


@dataclass
class JobFileWatch:
    """Reads `spec.rollout.replicas` from the job file again whenever the file changes."""

    path: Path
    replicas: int
    _stamp: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def poll(self) -> tuple[int | None, str | None]:
        """(new replica count, None) after an edit that changes it; (None, why) after a bad edit;
        (None, None) otherwise."""
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return None, None
        self._stamp = stamp
        try:
            replicas = load_job(self.path).spec.rollout.replicas
        except PlanError as e:
            return None, f"edit of {self.path} ignored: {e}"
        if replicas == self.replicas:
            return None, None
        self.replicas = replicas
        return replicas, None


def rollout_pod(template: PodCommand, index: int) -> PodCommand:
    """Rollout pod `index`, rendered like the others: pod 0's command with its own index."""
    env = {**template.env, ENV_POD_INDEX: str(index)}
    return PodCommand(template.role, index, list(template.argv), env, template.cwd, template.grace_s)


def with_endpoints(contract: RunContract, endpoints: list[str]) -> RunContract:
    """The contract listing `endpoints` as its rollout servers (what the operator renders from the
    live replica count)."""
    rollout = contract.rollout.model_copy(update={"endpoints": list(endpoints), "replicas": len(endpoints)})
    return contract.model_copy(update={"rollout": rollout})


def contract_path(template: PodCommand) -> Path:
    return Path(template.env[ENV_CONTRACT])


def write_contract(path: Path, contract: RunContract) -> None:
    """Replace the contract file whole (write, then rename), as the kubelet swaps a ConfigMap volume:
    a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(contract.model_dump_json(by_alias=True, exclude_none=True, indent=2))
    os.replace(tmp, path)
