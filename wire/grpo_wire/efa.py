"""What a process on an EFA node needs for DeepEP v2 over NCCL GIN, decided in one place for the
trainer (`grpo_trainer.moe.backends.deepep_v2`) and the rollout's vLLM processes
(`grpo_rollout.engines.vllm_deepep`): DeepEP v2's SM and QP counts on EFA, and the prerequisites a
pod can only learn at start-up (GIN's GDRCopy, the net plugin, the locked-memory limit).

DeepEP v2 counts (DeepEP at the Dockerfile's DEEPEP_COMMIT dd758caf, `deep_ep/buffers/elastic.py`):
- QPs: with `num_allocated_qps=0` the buffer allocates 129 QPs in hybrid mode (elastic.py:328-335),
  more than aws-ofi-nccl's 128-slot per-peer GIN request ring ("Next sequence number is in use" at
  the first dispatch; DeepEP PR #612, aws-ofi-nccl PR #1206). EFA_QPS are allocated and used.
- SMs: `get_theoretical_num_sms` (elastic.py:729-834) reads the RDMA speed from `ibstat` for
  `mlx5_0` (`deep_ep/utils/envs.py` `get_rdma_gbs`), 0 on EFA, and divides by it once the EP group
  spans nodes (elastic.py:809): ZeroDivisionError. EFA_SMS are given instead.

GIN prerequisites (aws-ofi-nccl 1.21.1, `src/rdma/gin/nccl_ofi_gin_api.cpp`, refuses GIN without a
working GDRCopy >= 2.5): the `gdrdrv` device, which the NVIDIA container toolkit puts in a container
that sets NVIDIA_GDRCOPY=enabled (the renderer does for every pod that runs GIN), GDRCopy's user
library (both images ship it, /opt/gdrcopy), and the net/GIN plugin NCCL_NET_PLUGIN names. Any EFA
device in a pod needs an unlimited RLIMIT_MEMLOCK: libfabric pins every buffer NCCL and DeepEP
register, and a non-root process (both images run as UID 1000) gains nothing from IPC_LOCK, so the
limit the node's container runtime sets is the one that counts (docs/install-eks.md).
"""

from __future__ import annotations

import ctypes
import glob
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass

EFA_SMS = 12  # the AWS launcher's value for DeepEP v2 on p5/p5en
EFA_QPS = 2  # upstream's EFA guidance (DeepEP PR #612, 2 x p5.48xlarge, Qwen3-30B-A3B)
GDRCOPY_MIN = (2, 5)
GDRDRV = "/dev/gdrdrv"
GDRAPI = "libgdrapi.so.2"
UVERBS = "/dev/infiniband/uverbs*"  # what the EFA device plugin puts in a pod, one per device
UNLIMITED = resource.RLIM_INFINITY


def on_efa(env: Mapping[str, str]) -> bool:
    """The pod runs on EFA: the renderer sets FI_PROVIDER=efa on pods that hold EFA devices."""
    return env.get("FI_PROVIDER") == "efa"


def deepep_counts(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """(SMs, QPs) of every DeepEP v2 dispatch and combine: GRPO_DEEPEP_NUM_SMS / GRPO_DEEPEP_NUM_QPS
    where set, else EFA_SMS and EFA_QPS on EFA, else None (v2's own estimate). Refuses a count that
    is not a positive integer, naming the variable."""
    efa = on_efa(env)
    counts = []
    for name, default in (("GRPO_DEEPEP_NUM_SMS", EFA_SMS), ("GRPO_DEEPEP_NUM_QPS", EFA_QPS)):
        text = env.get(name, str(default) if efa else "")
        if not text:
            counts.append(None)
            continue
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{name} must be a positive integer, got {text!r}")
        counts.append(int(text))
    return counts[0], counts[1]


@dataclass(frozen=True)
class NodeFacts:
    """What a pod can see of its node's GIN and RDMA prerequisites (gathered by `probe`)."""

    gdrdrv: bool  # /dev/gdrdrv is in the container
    gdrcopy: tuple[int, int] | str  # libgdrapi's runtime version, or why it does not load
    net_plugin: str | None  # NCCL_NET_PLUGIN's library as found, None where none is found
    net_plugin_name: str  # the file NCCL would load
    rdma_devices: int  # EFA devices (uverbs) in the container
    memlock: tuple[int, int]  # RLIMIT_MEMLOCK (soft, hard) after raising soft to hard


def gin_problems(facts: NodeFacts) -> list[str]:
    """What NCCL GIN over aws-ofi-nccl lacks in this pod, one line each (pure)."""
    problems = []
    if not facts.gdrdrv:
        problems.append(
            f"{GDRDRV} is missing: the node needs GDRCopy's gdrdrv kernel module and the NVIDIA container "
            "toolkit must inject it (the pod sets NVIDIA_GDRCOPY=enabled; docs/install-eks.md)"
        )
    if isinstance(facts.gdrcopy, str):
        problems.append(f"GDRCopy's library {GDRAPI} does not load: {facts.gdrcopy}")
    elif facts.gdrcopy < GDRCOPY_MIN:
        have, need = ".".join(map(str, facts.gdrcopy)), ".".join(map(str, GDRCOPY_MIN))
        problems.append(f"GDRCopy {have} is loaded; aws-ofi-nccl's GIN needs >= {need}")
    if facts.net_plugin is None:
        problems.append(f"NCCL's net plugin {facts.net_plugin_name} is not on LD_LIBRARY_PATH")
    return problems


def memlock_problems(facts: NodeFacts) -> list[str]:
    """An EFA pod whose locked-memory limit is finite (pure): libfabric cannot pin NCCL's buffers."""
    soft, _ = facts.memlock
    if facts.rdma_devices == 0 or soft == UNLIMITED:
        return []
    return [
        f"RLIMIT_MEMLOCK is {soft} bytes with {facts.rdma_devices} EFA devices in the pod; EFA needs it "
        "unlimited. IPC_LOCK does not lift it for a non-root process: set the node's container runtime "
        "limit (containerd LimitMEMLOCK=infinity, the EKS AMI's default; docs/install-eks.md)"
    ]


def net_plugin_file(env: Mapping[str, str]) -> str:
    """The library NCCL loads for NCCL_NET_PLUGIN (NCCL 2.x: `libnccl-net-<name>.so` for a bare
    name, the name itself where it is a file name)."""
    name = env.get("NCCL_NET_PLUGIN", "")
    if not name:
        return "libnccl-net.so"
    return name if name.endswith(".so") or "/" in name else f"libnccl-net-{name}.so"


def find_library(name: str, env: Mapping[str, str]) -> str | None:
    if "/" in name:
        return name if os.path.exists(name) else None
    dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/usr/lib/x86_64-linux-gnu", "/usr/lib", "/usr/local/lib", "/lib/x86_64-linux-gnu"]
    return next((os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))), None)


def gdrcopy_version() -> tuple[int, int] | str:
    """GDRCopy's runtime version (`gdr_runtime_get_version`, gdrapi.h since 2.1), or why not."""
    try:
        lib = ctypes.CDLL(GDRAPI)
    except OSError as e:
        return str(e)
    major, minor = ctypes.c_int(), ctypes.c_int()
    try:
        lib.gdr_runtime_get_version(ctypes.byref(major), ctypes.byref(minor))
    except AttributeError:
        return (2, 0)  # before 2.1: older than any GIN accepts
    return (major.value, minor.value)


def raised_memlock() -> tuple[int, int]:
    """RLIMIT_MEMLOCK after raising the soft limit to the hard one (an unprivileged process may)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft, hard


def probe(env: Mapping[str, str] | None = None) -> NodeFacts:
    """The facts of this process's pod (I/O: devices, the dynamic loader, rlimits)."""
    env = os.environ if env is None else env
    plugin = net_plugin_file(env)
    return NodeFacts(
        gdrdrv=os.path.exists(GDRDRV),
        gdrcopy=gdrcopy_version(),
        net_plugin=find_library(plugin, env),
        net_plugin_name=plugin,
        rdma_devices=len(glob.glob(UVERBS)),
        memlock=raised_memlock(),
    )
