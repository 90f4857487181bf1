"""Built-in `exact_match`: 1 when the completion, trimmed, equals the `answer` column, else 0.

For tasks whose answer is a short string (arithmetic results, labels); the scorer calls it.
"""

from typing import Any

from grpo_rollout.rewards.base import BUILTINS, require_column


@BUILTINS.register("exact_match")
def exact_match(prompts: list[str], completions: list[str], **columns: list[Any]) -> list[float]:
    answers = require_column(columns, "answer", "exact_match")
    return [
        float(answer is not None and completion.strip() == str(answer).strip())
        for completion, answer in zip(completions, answers, strict=True)
    ]
