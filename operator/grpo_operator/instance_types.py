"""The one table of EC2 instance types the renderer knows: GPUs, GPU memory and EFA devices per node.

`grpo_operator.render` reads it to size trainer and rollout pods (docs/install-eks.md has the
EFA facts), `grpo-operator plan` for the GPU memory budget. It is kept in code so a render needs no
cluster, and it is overridable because AWS adds instance types faster than we release:
`load(path)` merges a YAML/JSON file (for example a mounted ConfigMap, `grpo-operator operator
--instance-types FILE` or env `GRPO_INSTANCE_TYPES`) over the built-in rows.
"""

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

ENV_INSTANCE_TYPES = "GRPO_INSTANCE_TYPES"
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


@dataclass(frozen=True)
class InstanceType:
    """One row: what a whole node of this type offers to a pod."""

    name: str
    gpus: int
    efa: int
    gpu_resource: str = GPU_RESOURCE
    rdma: bool = True
    """rdma: EFA supports device RDMA on this type (FI_EFA_USE_DEVICE_RDMA=1)."""
    gpu_memory_mib: int = 0
    """gpu_memory_mib: memory of one GPU as nvidia-smi reports it (0: unknown or no GPU); the
    budget of `grpo-operator plan` (grpo_operator.memory_plan)."""

    @property
    def gpu_memory_bytes(self) -> int | None:
        return self.gpu_memory_mib * 2**20 if self.gpus and self.gpu_memory_mib else None


_BUILTIN: tuple[InstanceType, ...] = (
    InstanceType("p4d.24xlarge", gpus=8, efa=4, gpu_memory_mib=40960),  # A100 40 GB
    InstanceType("p4de.24xlarge", gpus=8, efa=4, gpu_memory_mib=81920),  # A100 80 GB
    InstanceType("p5.48xlarge", gpus=8, efa=32, gpu_memory_mib=81559),  # H100 80 GB
    InstanceType("p5e.48xlarge", gpus=8, efa=32, gpu_memory_mib=143771),  # H200 141 GB
    InstanceType("p5en.48xlarge", gpus=8, efa=16, gpu_memory_mib=143771),  # H200 141 GB
    InstanceType("p6-b200.48xlarge", gpus=8, efa=8, gpu_memory_mib=183359),  # B200 180 GB
    InstanceType("p6-b300.48xlarge", gpus=8, efa=16, gpu_memory_mib=275040),  # B300 288 GB
    InstanceType("g5.xlarge", gpus=1, efa=0, rdma=False, gpu_memory_mib=23028),  # A10G 24 GB
    InstanceType("g5.2xlarge", gpus=1, efa=0, rdma=False, gpu_memory_mib=23028),
    InstanceType("g5.48xlarge", gpus=8, efa=1, rdma=False, gpu_memory_mib=23028),
    InstanceType("g6e.xlarge", gpus=1, efa=0, rdma=False, gpu_memory_mib=46068),  # L40S 48 GB
    InstanceType("m7i.8xlarge", gpus=0, efa=0, rdma=False),
    InstanceType("c7i.8xlarge", gpus=0, efa=0, rdma=False),
)


_ALIASES = {"gpuResource": "gpu_resource", "gpuMemoryMiB": "gpu_memory_mib"}  # camelCase in YAML/JSON files


class UnknownInstanceType(KeyError):
    """An instance type the table has no row for; str() is the user-facing message."""

    def __str__(self) -> str:
        return str(self.args[0])


class InstanceTable:
    """A read-only mapping name → InstanceType with a clear error for unknown names."""

    def __init__(self, rows: Mapping[str, InstanceType]) -> None:
        self._rows = dict(rows)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def names(self) -> list[str]:
        return sorted(self._rows)

    def get(self, name: str) -> InstanceType:
        try:
            return self._rows[name]
        except KeyError:
            raise UnknownInstanceType(
                f"unknown instance type {name!r}: the operator's table knows {', '.join(self.names())}; "
                f"add a row with --instance-types FILE (or ${ENV_INSTANCE_TYPES})"
            ) from None

    def merged(self, overrides: Mapping[str, Mapping[str, Any]]) -> "InstanceTable":
        """A new table with rows added or fields replaced, e.g. {"p5.48xlarge": {"efa": 32}}."""
        rows = dict(self._rows)
        for name, fields in overrides.items():
            if not isinstance(fields, Mapping):
                raise ValueError(f"instance type {name!r}: expected a mapping of fields, got {fields!r}")
            unknown = set(fields) - {"gpus", "efa", "rdma", *_ALIASES, *_ALIASES.values()}
            if unknown:
                raise ValueError(f"instance type {name!r}: unknown fields {sorted(unknown)}")
            clean = {_ALIASES.get(k, k): v for k, v in fields.items()}
            base = rows.get(name)
            if base is None:
                if "gpus" not in clean or "efa" not in clean:
                    raise ValueError(f"new instance type {name!r} needs both 'gpus' and 'efa'")
                rows[name] = InstanceType(name=name, **clean)
            else:
                rows[name] = replace(base, **clean)
        for row in rows.values():
            if row.gpus < 0 or row.efa < 0 or row.gpu_memory_mib < 0:
                raise ValueError(f"instance type {row.name!r}: gpus, efa and gpuMemoryMiB must be >= 0")
        return InstanceTable(rows)


BUILTIN = InstanceTable({row.name: row for row in _BUILTIN})


def load(path: str | os.PathLike[str] | None = None) -> InstanceTable:
    """The built-in table, with the rows of `path` (or $GRPO_INSTANCE_TYPES) merged over it."""
    source = path if path is not None else os.environ.get(ENV_INSTANCE_TYPES)
    if not source:
        return BUILTIN
    text = Path(source).read_text()
    data = json.loads(text) if str(source).endswith(".json") else yaml.safe_load(text)
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a mapping of instance type name to fields")
    return BUILTIN.merged(data)
