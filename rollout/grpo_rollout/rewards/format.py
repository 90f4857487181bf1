"""Built-in `format`: 1 when the completion is `<think>...</think>` then `<answer>...</answer>`, else 0.

The R1-style structure reward, usually added with a small weight next to a correctness reward.
"""

import re
from typing import Any

THINK_ANSWER = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL)


def think_answer_format(prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
    return [float(THINK_ANSWER.match(c.strip()) is not None) for c in completions]
