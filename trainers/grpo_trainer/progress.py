"""Progress reports of trainer rank 0: one JSON line per step, and the GRPOJob status in a cluster.

Called by the training loop after every optimizer step (`step_record` builds the line).
Lines go to the file named by GRPO_PROGRESS_FILE (the local runtime follows it) or to stdout.
Inside a Kubernetes pod the same numbers are patched into the GRPOJob's `status.progress`
from a background thread that only ever holds the newest report: a slow or failing API server
costs a log line, never a training step. The pod's ServiceAccount needs `patch` on `grpojobs/status`.
"""

import json
import logging
import os
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any, TextIO

from grpo_operator.api.contract import RunContract
from grpo_operator.api.job import GROUP, PLURAL, VERSION
from grpo_operator.api.status import Progress

from grpo_trainer.batch import Rollouts
from grpo_trainer.checkpoint import TrainState

log = logging.getLogger(__name__)


class StatusPatcher:
    """Latest-wins, best-effort patcher of `status.progress` (daemon thread)."""

    def __init__(self, namespace: str, name: str, api: Any = None) -> None:
        """`api`: a kubernetes CustomObjectsApi; by default one with the pod's in-cluster identity."""
        if api is None:
            from kubernetes import client, config  # only in a cluster: keeps local start-up lean

            config.load_incluster_config()
            api = client.CustomObjectsApi()
        self._api = api
        self._namespace, self._name = namespace, name
        self._pending: dict[str, Any] | None = None
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="status-patcher", daemon=True).start()

    def submit(self, progress: dict[str, Any]) -> None:
        with self._cv:
            self._pending = progress
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None:
                    self._cv.wait()
                body, self._pending = {"status": {"progress": self._pending}}, None
            try:
                self._api.patch_namespaced_custom_object_status(
                    GROUP, VERSION, self._namespace, PLURAL, self._name, body, _request_timeout=10
                )
            except Exception as e:  # best effort by design: report, never raise into training
                log.warning("could not patch %s/%s status.progress: %s", self._namespace, self._name, e)
                time.sleep(5)


class ProgressReporter:
    """Writes rank 0's per-step records; also the GRPOJob status when running in a cluster."""

    def __init__(self, contract: RunContract, path: str | None, in_cluster: bool) -> None:
        self._out: TextIO = open(path, "a") if path else sys.stdout  # noqa: SIM115 - lives as long as training
        self._max_steps = contract.spec.algorithm.max_steps
        self._patcher: StatusPatcher | None = None
        if in_cluster:
            try:
                self._patcher = StatusPatcher(contract.namespace, contract.job_name)
            except Exception as e:  # no client, no ServiceAccount token: the JSON lines still flow
                log.warning("GRPOJob status progress disabled: %s", e)

    @classmethod
    def from_env(cls, contract: RunContract, env_name: str) -> "ProgressReporter":
        return cls(contract, os.environ.get(env_name), in_cluster="KUBERNETES_SERVICE_HOST" in os.environ)

    def report(self, record: dict[str, Any], *, checkpoint: tuple[str, int] | None = None) -> None:
        """`record` must hold step, reward_mean, tokens_per_s, weight_version; written as one line."""
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()
        if self._patcher is not None:
            progress = Progress(
                step=record["step"],
                max_steps=self._max_steps,
                reward_mean=record["reward_mean"],
                tokens_per_second=record["tokens_per_s"],
                weight_version=record["weight_version"],
                last_checkpoint=checkpoint[0] if checkpoint else None,
                last_checkpoint_step=checkpoint[1] if checkpoint else None,
                updated_at=datetime.now(UTC).isoformat(timespec="seconds"),
            )
            self._patcher.submit(progress.wire())

    def close(self) -> None:
        if self._out is not sys.stdout:
            self._out.close()


def step_record(
    state: TrainState, rollouts: Rollouts, staleness: int, extra: dict[str, float], wall: float
) -> dict[str, Any]:
    """Rank 0's line for the step just finished (gen_wait_s: generation not hidden behind training)."""
    tokens = sum(map(len, rollouts.prompt_tokens)) + rollouts.completion_tokens_total()
    return {
        "step": state.step,
        "reward_mean": sum(rollouts.rewards) / len(rollouts),
        "tokens_per_s": tokens / wall,
        "samples_per_s": len(rollouts) / wall,
        "samples": len(rollouts),
        "staleness": staleness,
        "weight_version": state.version,
        "position": state.position,
        "step_s": wall,
        "time": time.time(),
        **extra,
    }
