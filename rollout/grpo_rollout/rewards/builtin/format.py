"""Built-in `format`: 1 when the completion is `<think>...</think>` then `<answer>...</answer>`, else 0.

The R1-style structure reward, usually added with a small weight next to a correctness reward.
It is the regex `^<think>.*?</think>\\s*<answer>.*?</answer>$` read in one linear pass: that regex
backtracks over every `</think><answer>` of an unterminated completion, quadratic in its length.
"""

import re
from typing import Any

from grpo_rollout.rewards.base import BUILTINS

OPEN, CLOSE = "<think>", "</answer>"
SEAM = re.compile(r"</think>\s*<answer>")


def well_formed(completion: str) -> bool:
    """Starts with <think>, ends with </answer>, and the first </think><answer> seam fits between."""
    s = completion.strip()
    if not (s.startswith(OPEN) and s.endswith(CLOSE)):
        return False
    seam = SEAM.search(s, len(OPEN))  # the first seam ends first, so it is the one to try
    return seam is not None and seam.end() <= len(s) - len(CLOSE)


@BUILTINS.register("format")
def think_answer_format(prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
    return [float(well_formed(c)) for c in completions]
