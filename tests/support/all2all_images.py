"""What each vLLM all2all backend needs inside the rollout image, and which backends admission accepts.

vLLM 0.32.0 builds one all2all manager per backend name when a server's distributed state starts
(vllm/distributed/device_communicators/cuda_communicator.py:202-278), and each manager asserts its
package first: an engine core whose backend's package is missing dies at start-up, and LeaderWorkerSet
recreates the group in a loop. NEEDS is that reading, one line per name with the file and line; the
tests hold it against the Dockerfile's rollout stage (tests/unit/test_dockerfile.py) and the rollout
image's resolved packages (tests/integration/test_image_resolve.py), so a name the API accepts
without its package in the image fails there.
"""

import functools

import yaml
from grpo_operator import validation
from grpo_operator.api.roles import VllmAll2AllBackend
from grpo_operator.validation import check

# backend -> the import modules vLLM needs for it (vllm 0.32.0, paths under vllm/).
NEEDS: dict[str, tuple[str, ...]] = {
    # AgRsAll2AllManager: vLLM's own collectives (cuda_communicator.py:203-208).
    "allgather_reducescatter": (),
    # DeepEPV2All2AllManager asserts has_deep_ep_v2 (all2all.py:1112): `deep_ep` imports, has
    # ElasticBuffer, and the loaded NCCL is >= 2.30.4 (utils/import_utils.py:444, 472-509).
    "deepep_v2": ("deep_ep",),
    # DeepEPAll2AllManagerBase asserts has_deep_ep (all2all.py:219); both build deep_ep.Buffer.
    "deepep_high_throughput": ("deep_ep",),
    "deepep_low_latency": ("deep_ep",),
    # MoriAll2AllManager asserts has_mori (all2all.py:997): AMD ROCm's MoRI.
    "mori_high_throughput": ("mori",),
    "mori_low_latency": ("mori",),
    # MoonEPAll2AllManager calls check_moonep_system_support (utils/import_utils.py:532-543).
    "moonep": ("moonep",),
    # NixlEPAll2AllManager imports nixl_ep.Buffer (all2all.py:467).
    "nixl_ep": ("nixl_ep",),
    # FlashInfer*Manager assert has_flashinfer_nvlink_{two,one}_sided (all2all.py:671, :778):
    # flashinfer.comm's mnnvl and trtllm_(moe_)alltoall modules (utils/flashinfer.py:362-402).
    "flashinfer_nvlink_two_sided": ("flashinfer",),
    "flashinfer_nvlink_one_sided": ("flashinfer",),
}

# Import modules the rollout stage installs itself (Dockerfile): module -> its pip install argument.
INSTALLED_BY_THE_DOCKERFILE = {"deep_ep": "/ep-wheels/deep_ep-*.whl"}
# Import modules that come with the rollout's resolved packages: module -> distribution. flashinfer is
# a requirement of vllm 0.32.0's CUDA wheel (flashinfer-python==0.7.0.post1 in its METADATA).
RESOLVED_WITH_VLLM = {"flashinfer": "flashinfer-python"}

LAYOUTS = {
    "one node": {"vllm": {"dataParallelSize": 8, "expertParallelSize": 8}},
    "two nodes": {"nodesPerServer": 2, "vllm": {"dataParallelSize": 16, "expertParallelSize": 16}},
}


def manifest(backend: str, layout: str) -> str:
    """A p5en job whose rollout servers run `backend` over the given layout."""
    rollout = {"instanceType": "p5en.48xlarge", **LAYOUTS[layout]}
    rollout["vllm"] = {**rollout["vllm"], "all2allBackend": backend}
    return yaml.safe_dump(
        {
            "apiVersion": "grpo.dev/v1alpha1",
            "kind": "GRPOJob",
            "metadata": {"name": "a2a"},
            "spec": {
                "model": {"path": "s3://models/moe"},
                "dataset": {"path": "s3://datasets/train.jsonl"},
                "reward": {"functions": [{"builtin": "math"}]},
                "rollout": rollout,
            },
        }
    )


def verdicts(backend: str) -> dict[str, list[str]]:
    """Layout -> what offline validation (the CRD's rules and the renderer's) says of `backend` there."""
    out = {}
    for layout in LAYOUTS:
        text = manifest(backend, layout)
        problems = validation.validate_text(text) or check.render_problems(text)
        out[layout] = [str(p) for p in problems]
    return out


@functools.cache
def accepted() -> frozenset[str]:
    """The backends some rollout layout may run: those admission lets through in at least one."""
    names = [b.value for b in VllmAll2AllBackend if b != VllmAll2AllBackend.AUTO]
    return frozenset(n for n in names if any(not p for p in verdicts(n).values()))
