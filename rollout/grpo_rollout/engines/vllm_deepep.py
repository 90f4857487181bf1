"""DeepEP inside vLLM's own processes: imported our way, and v2 with EFA-safe counts.

A vLLM general plugin (entry point `vllm.general_plugins`, pyproject.toml): vLLM 0.32.0 runs it in
every process it starts, before that process makes any NCCL communicator: the engine core
(`v1/engine/core.py:127-129`, EngineCore.__init__) and each worker (`v1/worker/worker_base.py:274-276`,
`init_worker`, before the worker class is built; its `init_device` makes the communicators,
`v1/worker/gpu_worker.py:509`). Two things are wrong there without it, on EFA:

1. DeepEP's import check. vLLM imports `deep_ep` only when it builds its all2all manager
   (`distributed/device_communicators/all2all.py:1112`, `utils/import_utils.py:472-507`), after its
   NCCL communicator loaded aws-ofi-nccl (`libnccl-net-ofi.so`, a second "libnccl" path in
   /proc/self/maps): DeepEP's own `check_nccl_so` then refuses the import and every engine core dies.
   Imported here first, through `grpo_wire.deepep_import` (the trainer's import, plugins told apart
   from runtimes), the module is in `sys.modules` before vLLM asks for it.
2. DeepEP v2's counts. vLLM builds `deep_ep.ElasticBuffer(**kwargs)` without `num_allocated_qps`
   (all2all.py:1119-1137, 1177-1179), so DeepEP allocates 129 QPs in hybrid mode, and it asks
   `get_theoretical_num_sms` (all2all.py:1180-1184; every dispatch does too, DeepEP elastic.py:928),
   which divides by an `ibstat` speed EFA does not report. vLLM looks `deep_ep.ElasticBuffer` up at
   call time (all2all.py:1169-1178), so on EFA the plugin puts there a subclass that allocates and
   uses `grpo_wire.efa.deepep_counts` (the trainer's numbers, GRPO_DEEPEP_NUM_* overrides) and
   answers the SM count without ibstat. Nothing else of DeepEP or vLLM changes.

It acts only where the server resolved a DeepEP backend (ENV, set by `announce` before vLLM starts:
the pod's start-up check and the engine, inherited by vLLM's processes); anywhere else it does
nothing. It never raises: vLLM loads plugins in processes that must not die of an optional check;
where the import fails, vLLM's own gate stops the engine, and the pod's start-up check
(`grpo_rollout.preflight`) has already stated why.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from grpo_wire import efa
from grpo_wire.deepep_import import import_deep_ep

log = logging.getLogger(__name__)

ENV = "GRPO_VLLM_ALL2ALL"  # the server's resolved rollout.vllm.all2allBackend
V2 = "deepep_v2"
APIS = {V2: "ElasticBuffer", "deepep_high_throughput": "Buffer", "deepep_low_latency": "Buffer"}


def announce(backend: str | None, env: Any = os.environ) -> None:
    """Tell the vLLM processes this one starts which backend the server resolved (they inherit the
    environment); the pod's start-up check does so too, before any engine."""
    if backend in APIS:
        env[ENV] = backend


def register() -> None:
    """The `vllm.general_plugins` entry point (vLLM may call it more than once per process)."""
    backend = os.environ.get(ENV, "")
    if backend not in APIS:
        return
    try:
        prepare(backend, os.environ)
    except Exception:  # a plugin must not kill vLLM; vLLM's own gate speaks for a missing DeepEP
        log.exception("grpo: preparing DeepEP for vLLM's %s failed", backend)


def prepare(backend: str, env: Any) -> str:
    """Import DeepEP our way and, for v2 on EFA, install the EFA buffer. Returns what it did."""
    api, why = import_deep_ep(APIS[backend])
    if api is None:
        log.error("grpo: vLLM's all2all backend %s cannot use DeepEP here: %s", backend, why)
        return f"refused: {why}"
    if backend != V2:
        return "imported"
    sms, qps = efa.deepep_counts(env)
    if sms is None and qps is None:
        return "imported"
    module = sys.modules[api.__module__.split(".")[0]]
    if not getattr(module.ElasticBuffer, "grpo_efa", False):
        module.ElasticBuffer = efa_buffer(module.ElasticBuffer, sms, qps)
    log.info("grpo: DeepEP v2 in vLLM runs %s SMs and %s QPs (grpo_wire.efa)", sms, qps)
    return f"efa: {sms} SMs, {qps} QPs"


def efa_buffer(base: type, sms: int | None, qps: int | None) -> type:
    """`base` (deep_ep.ElasticBuffer) allocating `qps` QPs unless a caller asks otherwise, and
    answering `sms` for its SM estimate (pure: builds a class). DeepEP then uses min(its QP
    estimate, the allocated QPs) per call (elastic.py:836-853), i.e. `qps`."""

    class EfaElasticBuffer(base):  # type: ignore[misc, valid-type]
        grpo_efa = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if qps is not None and not kwargs.get("num_allocated_qps"):
                kwargs["num_allocated_qps"] = qps
            super().__init__(*args, **kwargs)

        if sms is not None:

            def get_theoretical_num_sms(self, *args: Any, **kwargs: Any) -> int:
                return sms

    EfaElasticBuffer.__name__ = EfaElasticBuffer.__qualname__ = "ElasticBuffer"
    EfaElasticBuffer.__module__ = base.__module__
    return EfaElasticBuffer
