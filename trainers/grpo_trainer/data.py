"""Prompt dataset (JSON Lines) and the deterministic order in which the loop draws it.

Used by the training loop: rank 0 asks `PromptOrder.take(position, n)` for each step's prompts.
The order of epoch e is a permutation seeded by (shuffleSeed, e), so the prompt at any global
position is a pure function of the position: a checkpoint stores the position of the first
prompt not yet trained on, and a resumed run continues there, no prompt skipped or repeated,
whatever was prefetched before the crash. Every row is validated on load; a bad one is a
`ConfigError` naming `FILE:LINE`.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grpo_trainer.config import ConfigError


@dataclass(frozen=True)
class Row:
    """One prompt: its text, its other columns (for the reward functions) and where it came from."""

    prompt: str
    columns: dict[str, Any]
    line: int


def load_rows(path: str | Path, prompt_field: str = "prompt") -> list[Row]:
    """Read and validate every row; raise ConfigError `FILE:LINE: reason` on the first bad one."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the dataset: {e}") from e
    rows = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
        prompt = obj.pop(prompt_field, None)
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{path}:{number}: field {prompt_field!r} missing or not a non-empty string")
        rows.append(Row(prompt=prompt, columns=obj, line=number))
    if not rows:
        raise ConfigError(f"{path}: the dataset has no rows")
    return rows


class PromptOrder:
    """Epoch-wise shuffled, endless stream of rows addressed by global position."""

    def __init__(self, rows: list[Row], seed: int) -> None:
        self.rows = rows
        self.seed = seed
        self._epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.rows), generator=gen).tolist()
            self._epoch = epoch
        return self._perm

    def at(self, position: int) -> Row:
        epoch, offset = divmod(position, len(self.rows))
        return self.rows[self._permutation(epoch)[offset]]

    def take(self, position: int, n: int) -> list[tuple[int, Row]]:
        """The n rows from `position` on, each with its global position (a unique prompt id)."""
        return [(p, self.at(p)) for p in range(position, position + n)]
