"""The plan's answer for one role: named parts (bytes + formula) against one GPU's memory.

Made by `memory_plan.trainer` and `memory_plan.rollout`; printed by `grpo-operator plan`, read
by `validate` and the trainer's start-up check.
"""

from dataclasses import dataclass, field
from typing import Any

from grpo_operator.memory_plan.inputs import GIB


@dataclass(frozen=True)
class Part:
    bytes: int
    formula: str


@dataclass(frozen=True)
class RolePlan:
    """Per-GPU memory of one role. `gpu_bytes` None: no fixed budget (CPU pods)."""

    role: str
    parts: dict[str, Part]
    gpu_bytes: int | None
    budget_bytes: int | None = None  # what the role may use of the GPU (vLLM: 90 %); gpu_bytes if None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    shortfall: str | None = None  # why it cannot fit although the total does (rollout: KV room)
    host: dict[str, Part] = field(default_factory=dict)  # host RAM per rank, outside the GPU budget
    advice: str | None = None  # what would fit, for a role that does not (the trainer's micro-batch)

    @property
    def host_total(self) -> int:
        return sum(p.bytes for p in self.host.values())

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts.values())

    @property
    def budget(self) -> int | None:
        return self.budget_bytes if self.budget_bytes is not None else self.gpu_bytes

    @property
    def fits(self) -> bool | None:
        if self.budget is None:
            return None
        return self.total <= self.budget and self.shortfall is None

    def verdict(self) -> str:
        """One line naming the numbers, e.g. for a log or an exit message."""
        have = f"{self.budget / GIB:.1f} GiB" if self.budget is not None else "no fixed budget (CPU)"
        word = {True: "fits", False: "does NOT fit", None: "planned"}[self.fits]
        line = f"{self.role}: {self.total / GIB:.1f} GiB per GPU, {word} in {have}"
        if self.shortfall:
            line += f": {self.shortfall}"
        biggest = sorted(self.parts.items(), key=lambda kv: -kv[1].bytes)[:3]
        line += " (largest: " + ", ".join(f"{k} {p.bytes / GIB:.1f} GiB" for k, p in biggest) + ")"
        if self.host:
            line += f"; plus {self.host_total / GIB:.1f} GiB of host RAM per rank (offloaded)"
        return line

    def refusal(self) -> str | None:
        """Why the role is refused, None when it fits or has no fixed budget: the one message that
        the trainer's start-up check raises and `grpo-operator validate` reports, word for word."""
        if self.fits is not False:
            return None
        advice = f"; {self.advice}" if self.advice else ""
        return f"{self.verdict()}{advice}; run `grpo-operator plan` on the job to see which settings fit"

    def to_json(self) -> dict[str, Any]:
        return {
            "gib_per_gpu": round(self.total / GIB, 2),
            "gpu_gib": round(self.gpu_bytes / GIB, 2) if self.gpu_bytes is not None else None,
            "budget_gib": round(self.budget / GIB, 2) if self.budget is not None else None,
            "fits": self.fits,
            "parts": {
                k: {"gib": round(p.bytes / GIB, 3), "bytes": p.bytes, "formula": p.formula}
                for k, p in self.parts.items()
            },
            **({"shortfall": self.shortfall} if self.shortfall else {}),
            **(
                {
                    "host_gib_per_rank": round(self.host_total / GIB, 2),
                    "host_parts": {
                        k: {"gib": round(p.bytes / GIB, 3), "bytes": p.bytes, "formula": p.formula}
                        for k, p in self.host.items()
                    },
                }
                if self.host
                else {}
            ),
            **self.extra,
            **({"advice": self.advice} if self.advice else {}),
            "notes": self.notes,
        }
