"""What one trainer process knows about itself: the run contract plus its place in the gang.

Read by the per-pod launcher (`grpo_trainer.launcher`) and by every rank (`grpo_trainer.loop`).
The contract comes from the file named by GRPO_CONTRACT (the mounted ConfigMap in a cluster,
a work-directory file under the local runtime); the launcher adds RANK, LOCAL_RANK and
WORLD_SIZE for each process it starts. `ConfigError` marks mistakes no restart can fix: the
launcher exits with `EXIT_CONFIG` so the operator and the local runtime stop retrying.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from grpo_operator.api.contract import (
    ENV_CONTRACT,
    ENV_POD_INDEX,
    ENV_TOKEN,
    RunContract,
)
from pydantic import ValidationError

MAX_GRAD_NORM = 1.0  # global gradient-norm clip (TRL's default); not a GRPOJob field


class ConfigError(Exception):
    """A permanent error in the job's configuration or inputs (bad contract, bad dataset row).

    `reason`, when set, is one of the API's trainer-stated reasons (`api.status.TRAINER_STATED`):
    the rank states it in its termination message and the job fails with it as its reason."""

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason

    def stated(self) -> str:
        """The termination message: `<Reason>: <message>`, or the message alone."""
        return f"{self.reason}: {self}" if self.reason else str(self)


def load_contract(env: dict[str, str] | None = None) -> RunContract:
    """Parse the contract named by GRPO_CONTRACT; the value may also be the JSON itself."""
    env = dict(os.environ) if env is None else env
    value = env.get(ENV_CONTRACT)
    if not value:
        raise ConfigError(f"{ENV_CONTRACT} is not set: the trainer needs the run contract (job.json)")
    try:
        text = value if value.lstrip().startswith("{") else Path(value).read_text()
    except OSError as e:
        raise ConfigError(f"{ENV_CONTRACT}={value}: cannot read the run contract: {e}") from e
    try:
        return RunContract.model_validate_json(text)
    except ValidationError as e:
        raise ConfigError(f"{ENV_CONTRACT}={value}: invalid run contract: {e}") from e


@dataclass(frozen=True)
class RankInfo:
    """This process's coordinates in the gang (world = dp x ep, EP groups are consecutive ranks)."""

    rank: int
    local_rank: int
    world_size: int
    pod_index: int
    ep_size: int

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, contract: RunContract, env: dict[str, str] | None = None) -> "RankInfo":
        env = dict(os.environ) if env is None else env
        try:
            info = cls(
                rank=int(env["RANK"]),
                local_rank=int(env.get("LOCAL_RANK", "0")),
                world_size=int(env["WORLD_SIZE"]),
                pod_index=int(env.get(ENV_POD_INDEX, "0")),
                ep_size=contract.trainer.expert_parallel_size,
            )
        except (KeyError, ValueError) as e:
            raise ConfigError(f"RANK/WORLD_SIZE env missing or not integers: {e}") from e
        if info.world_size != contract.trainer.world_size:
            raise ConfigError(
                f"WORLD_SIZE={info.world_size} but the contract says {contract.trainer.world_size}"
            )
        return info


def job_token(env: dict[str, str] | None = None) -> str:
    """The per-job bearer token for the rollout servers (GRPO_TOKEN)."""
    env = dict(os.environ) if env is None else env
    token = env.get(ENV_TOKEN, "")
    if not token:
        raise ConfigError(
            f"{ENV_TOKEN} is not set: the rollout servers refuse requests without the job token"
        )
    return token
