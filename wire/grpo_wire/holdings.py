"""Who holds what of a weight version, and who feeds whom: a member receives only what it holds.

A receiving member (a rollout server's process, or one of its engine's workers) holds either the
whole model or, under vLLM's expert parallelism, every dense tensor and the routed experts of its EP
rank. Members that hold the same experts form a *class*; the trainer filters each rank's share per
class (`clip` to `held_ranges`) and relays each class's stream only to that class's members, so a
member receives the dense weights once and its own experts, not the whole model.

`lanes` says who feeds whom. The F feeder ranks serve the classes in passes of at most F classes:
within a pass every feeder forwards one class's stream in one group (itself at rank 0, the members
of that class it was given at ranks 1..), so each member is in exactly one group, as before. With
one class (everyone holds everything) there is one pass and member m is fed by feeder m mod F at
rank 1 + m // F, the layout of a whole-model stream.

Expert placement is vLLM's (`expert_placement`): `determine_expert_map` of vLLM 0.32.0,
vllm/model_executor/layers/fused_moe/expert_map_manager.py:22-90 ("linear": contiguous blocks, the
first `experts % ep` ranks one more; "round_robin": rank r holds r, r + ep, ...).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

PLACEMENTS = ("linear", "round_robin")


def expert_placement(ep_rank: int, ep_size: int, experts: int, strategy: str = "linear") -> list[int]:
    """The routed experts EP rank `ep_rank` of `ep_size` holds, as vLLM places them."""
    if strategy not in PLACEMENTS:
        raise ValueError(f"unknown expert placement {strategy!r}: the trainer knows {list(PLACEMENTS)}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"EP rank {ep_rank} outside an EP group of {ep_size}")
    if ep_size == 1:
        return list(range(experts))
    if strategy == "round_robin":
        return list(range(ep_rank, experts, ep_size))
    base, extra = divmod(experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return list(range(start, start + base + (ep_rank < extra)))


def held_ranges(shape: Sequence[int], experts: Sequence[int] | None) -> list[tuple[int, int]]:
    """[lo, hi) element ranges of a flattened tensor whose dim 0 is the routed expert, for a holder
    of `experts` (None: the whole tensor); consecutive experts merge into one range."""
    per = 1
    for d in shape[1:]:
        per *= d
    if experts is None:
        return [(0, shape[0] * per)] if shape else [(0, 1)]
    out: list[tuple[int, int]] = []
    for e in sorted(set(experts)):
        if not 0 <= e < shape[0]:
            raise ValueError(f"expert {e} outside a tensor of {shape[0]} experts")
        lo, hi = e * per, (e + 1) * per
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def clip(start: int, count: int, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, start + count) inside `ranges` (sorted, disjoint), as (lo, hi)."""
    end = start + count
    return [(max(start, lo), min(end, hi)) for lo, hi in ranges if lo < end and hi > start]


@dataclass(frozen=True)
class Holding:
    """What one class of members holds: the routed experts (None: all) of the `expert_tensors`."""

    experts: tuple[int, ...] | None = None

    def ranges(
        self, name: str, shape: Sequence[int], expert_tensors: frozenset[str]
    ) -> list[tuple[int, int]]:
        """Element ranges of tensor `name` this class receives."""
        return held_ranges(shape, self.experts if name in expert_tensors else None)


@dataclass(frozen=True)
class Lanes:
    """Who feeds whom for members of the given classes (see the module doc)."""

    feeders: int
    passes: list[list[int]]
    """Per pass, the class each feeder forwards (-1: none in this pass)."""
    place: list[tuple[int, int, int]]
    """Per member: (pass, feeder, its rank in that feeder's group of that pass)."""
    sizes: dict[tuple[int, int], int] = field(default_factory=dict)
    """(pass, feeder) -> its group's size (the feeder and its members); absent: no group."""


def lanes(classes: Sequence[int], feeders: int) -> Lanes:
    """Lanes for members whose class is `classes[m]` (0..C-1, each present), over `feeders` ranks."""
    count = 1 + max(classes, default=-1)
    if feeders < 1 or not classes or sorted(set(classes)) != list(range(count)):
        raise ValueError(f"classes must number 0..C-1 and feeders be >= 1, got {list(classes)}, {feeders}")
    of_class: list[list[int]] = [[] for _ in range(count)]
    for m, c in enumerate(classes):
        of_class[c].append(m)
    passes: list[list[int]] = []
    place: list[tuple[int, int, int]] = [(0, 0, 0)] * len(classes)
    sizes: dict[tuple[int, int], int] = {}
    for p, first in enumerate(range(0, count, feeders)):
        here = list(range(first, min(count, first + feeders)))
        forwards = [-1] * feeders
        for c in here:
            # this class's feeders: every len(here)-th one, no more than it has members
            mine = [f for f in range(feeders) if f % len(here) == c - first][: len(of_class[c])]
            for f in mine:
                forwards[f] = c
            for j, m in enumerate(of_class[c]):
                f = mine[j % len(mine)]
                place[m] = (p, f, 1 + j // len(mine))
                sizes[(p, f)] = sizes.get((p, f), 1) + 1
        passes.append(forwards)
    return Lanes(feeders, passes, place, sizes)
