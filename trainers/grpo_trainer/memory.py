"""The trainer's start-up memory check: `grpo-operator plan`'s verdict before the model is loaded.

Called once by `grpo_trainer.loop.setup` on every rank, after the process group is up and before
any weight is allocated. Every rank computes the same plan (`grpo_operator.memory_plan`) from the
model's config.json (local, mounted or on S3) and the run contract; rank 0 logs it. On a GPU that
cannot hold the planned trainer the rank raises `ConfigError` (exit `EXIT_CONFIG`: the job fails
with the numbers as its reason instead of its pods dying of OOM, restart after restart). On CPU
there is no fixed budget: the plan is only logged. GRPO_MEMORY_PLAN=warn downgrades the refusal to
a warning (for a plan that is wrong about a job that does fit); GRPO_MEMORY_PLAN=off skips the check.
"""

import json
import logging
import os

import torch
from grpo_operator import memory_plan, storage
from grpo_operator.api.contract import RunContract

from grpo_trainer.config import ConfigError, RankInfo

log = logging.getLogger(__name__)
ENV_MEMORY_PLAN = "GRPO_MEMORY_PLAN"  # enforce (default) | warn | off


def _named(parts: dict[str, memory_plan.Part]) -> str:
    return ", ".join(f"{k} {p.bytes / memory_plan.GIB:.2f} GiB" for k, p in parts.items())


def _model_config(path: str) -> tuple[str, dict] | None:
    """(where, parsed config.json) of the model at `path`: a local (or mounted pvc://) directory, or
    s3:// read through the storage layer before any shard is fetched; None when there is none."""
    if storage.is_remote(path):
        uri = storage.join(path, "config.json")
        try:
            fs, remote = storage.filesystem(uri)
            return uri, json.loads(fs.cat_file(remote))
        except Exception as e:  # s3fs/botocore raise their own types; the loader reports the store
            log.warning("no memory plan: cannot read %s: %s", uri, e)
            return None
    source = memory_plan.find_config(path)
    return (str(source), json.loads(source.read_text())) if source is not None else None


def check(contract: RunContract, info: RankInfo, device: torch.device) -> memory_plan.RolePlan | None:
    """The trainer's plan on this rank's device; raises ConfigError when it cannot fit on a GPU.

    The plan is `memory_plan.plan_job`'s trainer part and the refusal `RolePlan.refusal()`: what
    `grpo-operator validate --model-config` reports for the same job, word for word."""
    mode = os.environ.get(ENV_MEMORY_PLAN, "enforce")
    if mode == "off":
        return None
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    try:
        found = _model_config(contract.spec.model.path)
        if found is None:
            return None
        source, config = found
        plan = memory_plan.plan_job(
            config, contract.spec, trainer_gpu_bytes=gpu, rollout_gpu_bytes=None
        ).trainer
    except (OSError, ValueError, TypeError, ArithmeticError) as e:  # unknown architecture: the loader decides
        log.warning("no memory plan for %s: %s", contract.spec.model.path, e)
        return None
    if info.is_main:
        parts = _named(plan.parts)
        if plan.host:  # optimizerOffload: what this rank keeps in host RAM instead
            parts += f"; host RAM: {_named(plan.host)}"
        log.info("memory plan: %s [%s] from %s", plan.verdict(), parts, source)
    refusal = plan.refusal()
    if refusal is not None:
        if mode != "warn":
            raise ConfigError(refusal)
        log.warning("%s (%s=warn: starting anyway)", refusal, ENV_MEMORY_PLAN)
    return plan
