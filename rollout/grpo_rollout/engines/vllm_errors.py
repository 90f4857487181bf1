"""The first error of vLLM's engine core, carried out of its process for the rollout server.

When vLLM's `EngineCore` process dies, the frontend only learns `EngineDeadError` ("EngineCore
encountered an issue. See stack trace (above) for the root cause.", vllm 0.32
`v1/engine/exceptions.py:13`): the cause is logged inside the core process, by
`logger.exception("EngineCore encountered a fatal error.")` on the `vllm.v1.engine.core` logger
(`v1/engine/core.py:1512`), just before it sends ENGINE_CORE_DEAD (`core.py:1513`). `FirstErrorFile`,
a handler on that logger, writes the first such error to a file the server process reads
(`VllmEngine.failure`). It reaches the core process both ways vLLM starts it: inherited by a forked
process (vLLM's default, `utils/system_utils.py:176`), and through `VLLM_LOGGING_CONFIG_PATH`
(`logger.py:213`, read by every process that imports vLLM) where vLLM must spawn (CUDA initialised,
`system_utils.py:144`). Imported by `grpo_rollout.engines.vllm_engine`, and by the core process.
"""

import contextlib
import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

CORE_LOGGER = "vllm.v1.engine.core"
HANDLER = "grpo_first_error"
MAX_CHARS = 4000  # what a pod's termination message keeps


class FirstErrorFile(logging.Handler):
    """Writes the first ERROR record of a process (its exception's own text when it has one) to
    `path`; later records are echoes of it and are ignored."""

    def __init__(self, path: str, level: int | str = logging.ERROR) -> None:
        super().__init__(level)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        text = f"{type(exc).__name__}: {exc}" if exc is not None else record.getMessage()
        # "x": the first error wins (FileExistsError for the later ones, its echoes)
        with contextlib.suppress(OSError), open(self.path, "x", encoding="utf-8") as f:
            f.write(text[:MAX_CHARS])


def logging_config(default: dict[str, Any], path: str) -> dict[str, Any]:
    """vLLM's own logging config (`vllm.logger.DEFAULT_LOGGING_CONFIG`) plus `FirstErrorFile` on the
    engine core's logger, whose records still reach vLLM's handler through propagation."""
    config = copy.deepcopy(default)
    config.setdefault("handlers", {})[HANDLER] = {
        "()": f"{__name__}.FirstErrorFile",
        "path": path,
        "level": "ERROR",
    }
    config.setdefault("loggers", {})[CORE_LOGGER] = {"handlers": [HANDLER], "propagate": True}
    return config


def capture(workdir: Path) -> Path:
    """Arrange for the engine core's first error to land in `workdir/engine-error.txt` (returned);
    call before the engine starts. A logging config the user set (VLLM_LOGGING_CONFIG_PATH) is left
    alone: then only a forked core process reports its error."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    path = workdir / "engine-error.txt"
    path.unlink(missing_ok=True)
    logging.getLogger(CORE_LOGGER).addHandler(FirstErrorFile(str(path)))  # a forked core inherits it
    if not os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        config_file = workdir / "vllm-logging.json"
        config_file.write_text(json.dumps(logging_config(DEFAULT_LOGGING_CONFIG, str(path))))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_file)  # a spawned core reads it
    return path


def read(path: Path) -> str | None:
    """The recorded first error, if the core logged one."""
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
