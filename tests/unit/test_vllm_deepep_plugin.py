"""DeepEP inside vLLM's processes (grpo_rollout.engines.vllm_deepep, issue 45): imported our way, and
DeepEP v2 built the way vLLM builds it (keyword arguments only, no `num_allocated_qps`, the SM count
asked of the buffer) runs the trainer's EFA counts. Against a stand-in of upstream's ElasticBuffer
that does what the pinned DeepEP does on EFA (129 QPs allocated, a division by ibstat's 0 GB/s)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from grpo_rollout.engines import vllm_deepep

from tests.support import deepep_stand_in

# vLLM 0.32.0's DeepEPV2All2AllManager._make_all2all_kwargs (all2all.py:1119-1137), as it builds them
VLLM_KWARGS = dict(
    group=None, num_max_tokens_per_rank=256, hidden=7168, num_topk=8, use_fp8_dispatch=False,
    allow_hybrid_mode=True, prefer_overlap_with_compute=False, allow_multiple_reduction=False,
    explicitly_destroy=True,
)  # fmt: skip


@pytest.fixture
def upstream(tmp_path: Path):
    deepep_stand_in.write(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("deep_ep.buffers.elastic").ElasticBuffer
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "deep_ep" or m.startswith("deep_ep.")]:
            del sys.modules[name]


def test_as_vllm_builds_it_upstreams_buffer_overflows_efas_ring_and_divides_by_zero(upstream) -> None:
    buffer = upstream(**VLLM_KWARGS)
    assert buffer.num_allocated_qps == 129  # > aws-ofi-nccl's 128-slot GIN ring
    with pytest.raises(ZeroDivisionError):
        buffer.get_theoretical_num_sms(num_experts=256, num_topk=8)  # vLLM's get_handle, all2all.py:1181


def test_the_efa_buffer_allocates_and_uses_the_trainers_counts(upstream) -> None:
    efa_buffer = vllm_deepep.efa_buffer(upstream, 12, 2)
    buffer = efa_buffer(**VLLM_KWARGS)
    assert isinstance(buffer, upstream) and efa_buffer.__name__ == "ElasticBuffer"
    assert buffer.num_allocated_qps == 2
    assert buffer.get_theoretical_num_sms(num_experts=256, num_topk=8) == 12
    assert buffer.dispatch(x=None, num_experts=256, num_topk=8) == (12, 2)  # vLLM passes neither count
    assert efa_buffer(**VLLM_KWARGS, num_allocated_qps=8).num_allocated_qps == 8  # a caller's own wins


PLUGIN = textwrap.dedent(
    """
    import json, sys
    from grpo_rollout.engines import vllm_deepep
    vllm_deepep.register(); vllm_deepep.register()  # vLLM may load plugins more than once
    import deep_ep
    cls = deep_ep.ElasticBuffer
    b = cls(group=None, num_max_tokens_per_rank=8, hidden=16, num_topk=2)
    print(json.dumps({"efa": getattr(cls, "grpo_efa", False), "qps": b.num_allocated_qps,
                      "subclassed_once": cls.__mro__[1].__module__ == "deep_ep.buffers.elastic"}))
    """
)


def run_plugin(root: Path, **env: str) -> str:
    deepep_stand_in.write(root)
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    base = {k: v for k, v in os.environ.items() if k not in (vllm_deepep.ENV, "FI_PROVIDER")}
    done = subprocess.run(
        [sys.executable, "-c", PLUGIN], env=base | {"PYTHONPATH": path} | env,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_plugin_installs_the_efa_buffer_once_where_the_server_resolved_deepep_v2_on_efa(tmp_path) -> None:
    out = run_plugin(tmp_path, GRPO_VLLM_ALL2ALL="deepep_v2", FI_PROVIDER="efa")
    assert out == '{"efa": true, "qps": 2, "subclassed_once": true}'


def test_the_plugin_leaves_deepep_as_shipped_off_efa_and_for_other_backends(tmp_path) -> None:
    assert run_plugin(tmp_path, GRPO_VLLM_ALL2ALL="deepep_v2") == (
        '{"efa": false, "qps": 129, "subclassed_once": false}'
    )
    assert run_plugin(tmp_path, GRPO_VLLM_ALL2ALL="allgather_reducescatter", FI_PROVIDER="efa") == (
        '{"efa": false, "qps": 129, "subclassed_once": false}'
    )


def test_a_deepep_that_refuses_to_import_never_raises_out_of_the_plugin(tmp_path) -> None:
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("raise AssertionError('Duplicate NCCL runtime')\n")
    env = {"PYTHONPATH": str(tmp_path), vllm_deepep.ENV: "deepep_v2", "FI_PROVIDER": "efa"}
    code = (
        "from grpo_rollout.engines import vllm_deepep as p\n"
        "print(p.prepare('deepep_v2', {'FI_PROVIDER': 'efa'}))\np.register()"
    )
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], env=os.environ | env | {"PYTHONPATH": path},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("refused: deep_ep does not import (AssertionError: Duplicate NCCL runtime)")
