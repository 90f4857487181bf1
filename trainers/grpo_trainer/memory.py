"""The trainer's start-up memory check: `grpo-operator plan`'s verdict before the model is loaded.

Called once by `grpo_trainer.loop.setup` on every rank, after the process group is up and before
any weight is allocated. Every rank computes the same plan (`grpo_operator.memory_plan`) from the
model's config.json and the run contract; rank 0 logs it. On a GPU that cannot hold the planned
trainer the rank raises `ConfigError` (exit `EXIT_CONFIG`: the job fails with the numbers as its
reason instead of its pods dying of OOM, restart after restart). On CPU there is no fixed budget:
the plan is only logged. GRPO_MEMORY_PLAN=warn downgrades the refusal to a warning (for a plan
that is wrong about a job that does fit); GRPO_MEMORY_PLAN=off skips the check.
"""

import json
import logging
import os

import torch
from grpo_operator import memory_plan
from grpo_operator.api.contract import RunContract

from grpo_trainer.config import ConfigError, RankInfo

log = logging.getLogger(__name__)
ENV_MEMORY_PLAN = "GRPO_MEMORY_PLAN"  # enforce (default) | warn | off


def _named(parts: dict[str, memory_plan.Part]) -> str:
    return ", ".join(f"{k} {p.bytes / memory_plan.GIB:.2f} GiB" for k, p in parts.items())


def check(contract: RunContract, info: RankInfo, device: torch.device) -> memory_plan.RolePlan | None:
    """The trainer's plan on this rank's device; raises ConfigError when it cannot fit on a GPU."""
    mode = os.environ.get(ENV_MEMORY_PLAN, "enforce")
    source = memory_plan.find_config(contract.spec.model.path)
    if mode == "off" or source is None:
        return None
    try:
        shape = memory_plan.from_config(json.loads(source.read_text()))
    except (OSError, ValueError, TypeError, ArithmeticError) as e:  # unknown architecture: the loader decides
        log.warning("no memory plan for %s: %s", source, e)
        return None
    trainer, _ = memory_plan.inputs_from_spec(contract.spec)
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    plan = memory_plan.plan_trainer(shape, trainer, gpu)
    if info.is_main:
        parts = _named(plan.parts)
        if plan.host:  # optimizerOffload: what this rank keeps in host RAM instead
            parts += f"; host RAM: {_named(plan.host)}"
        log.info("memory plan: %s [%s]", plan.verdict(), parts)
    if plan.fits is False:
        message = f"{plan.verdict()}; run `grpo-operator plan` on the job to see which settings fit"
        if mode != "warn":
            raise ConfigError(message)
        log.warning("%s (%s=warn: starting anyway)", message, ENV_MEMORY_PLAN)
    return plan
