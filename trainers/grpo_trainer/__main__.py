"""`python -m grpo_trainer {train,rank}`: the trainer container's entry points.

`train` is the per-pod launcher (`grpo_trainer.launcher`); `rank` is one rank process it
spawns (`grpo_trainer.loop.train`), with RANK/WORLD_SIZE in its env. A `ConfigError` exits
with `EXIT_CONFIG` so the gang is not restarted for a mistake a restart cannot fix; a rank
stopped by SIGTERM/SIGINT saves a checkpoint and exits with `EXIT_STOPPED` (128 + SIGTERM).
"""

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from grpo_operator.api.contract import EXIT_CONFIG, EXIT_STOPPED, write_termination_message
from grpo_operator.api.status import Reason

from grpo_trainer.config import ConfigError, RankInfo, load_contract


def check_efa(env: Mapping[str, str] = os.environ, probe: Callable[[], Any] | None = None) -> None:
    """An EFA pod whose node cannot pin memory fails at once with the reason (`grpo_wire.efa`),
    instead of NCCL failing to register its first buffer deep inside a collective."""
    from grpo_wire import efa

    if efa.on_efa(env) and (problems := efa.memlock_problems((probe or efa.probe)())):
        raise ConfigError("; ".join(problems), reason=Reason.EFA_MISCONFIGURED)


def rank_main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank-%(process)d %(name)s: %(message)s")
    try:
        contract = load_contract()
        info = RankInfo.from_env(contract)
        check_efa()
        from grpo_trainer.loop import train  # torch and transformers load only for real work

        finished = train(contract, info)
    except ConfigError as e:
        print(f"grpo-trainer: configuration error: {e.stated()}", file=sys.stderr)
        write_termination_message(e.stated(), who="grpo-trainer")
        return EXIT_CONFIG
    return 0 if finished else EXIT_STOPPED


def main(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        from grpo_trainer.launcher import main as launch

        return launch()
    if argv[:1] == ["rank"]:
        return rank_main()
    print("usage: python -m grpo_trainer {train|rank}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
