"""A stand-in `deep_ep` package for machines without CUDA: what DeepEP v2 does at the Dockerfile's
DEEPEP_COMMIT (dd758caf, `deep_ep/buffers/elastic.py`) in the parts our EFA settings change, written
out as a package a fresh interpreter (or vLLM's processes) can import."""

from pathlib import Path

ELASTIC = '''
import math


class ElasticBuffer:
    """The parts of upstream's ElasticBuffer the EFA settings change, as upstream has them."""

    def __init__(self, group, num_bytes=0, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0, num_topk=0,
                 use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True,
                 allow_multiple_reduction=True, prefer_overlap_with_compute=True, sl_idx=3,
                 num_allocated_qps=0, num_cpu_timeout_secs=300, num_gpu_timeout_secs=100,
                 explicitly_destroy=False):
        self.allow_hybrid_mode = allow_hybrid_mode
        self.num_scaleout_ranks = 4  # an EP group over 4 nodes
        if num_allocated_qps == 0:  # elastic.py:328-335, no fast RDMA atomics (EFA)
            num_allocated_qps = 129 if allow_hybrid_mode else 17
        self.num_allocated_qps = num_allocated_qps

    def get_theoretical_num_sms(self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0, nvlink_gbs=0):
        rdma_gbs = rdma_gbs or 0  # get_rdma_gbs(): ibstat has no mlx5_0 on EFA (envs.py)
        rdma_traffic = 1.0
        if self.num_scaleout_ranks > 1 and (rdma_traffic / rdma_gbs) > 1:  # elastic.py:809
            return 0
        return 0

    def get_theoretical_num_qps(self, num_sms):
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)  # elastic.py:836-853
        return min(num_qps, self.num_allocated_qps)

    def dispatch(self, x, num_experts=None, num_topk=None, num_sms=0, num_qps=0):
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms  # :928
        num_qps = self.get_theoretical_num_qps(num_sms) if num_qps == 0 else num_qps
        assert num_qps <= self.num_allocated_qps, "Allocated QPs are not enough"
        return num_sms, num_qps
'''
INIT = (
    "from .buffers.elastic import ElasticBuffer\nBuffer = type('Buffer', (), {})\n__version__ = 'stand-in'\n"
)
FIND_PKGS = (
    "import os\n\ndef find_nccl_root():\n    return os.environ.get('STAND_IN_NCCL_ROOT', '/nonexistent')\n"
)


def write(root: Path) -> Path:
    """The package under `root` (put `root` on PYTHONPATH); returns `root`."""
    pkg = root / "deep_ep"
    for sub in ("buffers", "utils"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(INIT)
    (pkg / "buffers" / "elastic.py").write_text(ELASTIC)
    (pkg / "utils" / "find_pkgs.py").write_text(FIND_PKGS)
    return root
