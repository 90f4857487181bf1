"""Prompt dataset (JSON Lines or Parquet, local or s3://) and the deterministic order the loop draws it in.

Used by the training loop: rank 0 asks `PromptOrder.take(position, n)` for each step's prompts.
The order of epoch e is a permutation seeded by (shuffleSeed, e), so the prompt at any global
position is a pure function of the position: a checkpoint stores the position of the first
prompt not yet trained on, and a resumed run continues there, no prompt skipped or repeated,
whatever was prefetched before the crash. Every row is validated on load; a bad one is a
`ConfigError` naming the spec field and `FILE:LINE` (JSON Lines) or `FILE: row N` (Parquet). The
path is first judged by the rule `validate --check-paths` applies offline (`grpo_operator.storage.check`),
and a dataset without a usable row fails the job with `DatasetEmpty`.

A prompt is a string or a list of chat messages (`{role, content}`; verl's preprocessed parquet,
TRL's conversational files and OpenAI-style files write it so): the rollout server puts either
through the model's chat template (`grpo_wire.chat`). `spec.dataset.columns` maps the names the
reward functions receive to dotted paths in the row (`reward_model.ground_truth`); the row's other
top-level columns are passed under their own names.

Files are streamed through `grpo_operator.storage` (fsspec; s3fs for s3://): JSON Lines line by
line, Parquet row group by row group (pyarrow reads the footer, then one group's byte ranges at
a time), so a dataset is never downloaded whole before its first row is checked. A folder (or
an s3:// prefix) means every `.jsonl`/`.json`/`.parquet` file in it, in name order.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from grpo_operator import storage
from grpo_operator.api.spec import DatasetSpec
from grpo_operator.api.status import Reason
from grpo_operator.storage.check import DATA_SUFFIXES, PARQUET_SUFFIXES, POD_CREDENTIALS, Expect, PathError
from grpo_operator.storage.check import check as check_path

from grpo_trainer.config import ConfigError

DATASET_FIELD = "spec.dataset.path"


ROLES = ("system", "user", "assistant", "tool")
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Row:
    """One prompt: its text or chat messages, the columns the reward functions get and where it came
    from (the line of a JSON Lines file, the 1-based row of a Parquet file)."""

    prompt: str | Messages
    columns: dict[str, Any]
    line: int
    where: str = ""  # FILE:LINE or FILE: row N, for errors found later (a prompt the template refuses)


@dataclass(frozen=True)
class RowShape:
    """How a row is read: which column is the prompt, and the named columns' dotted paths."""

    prompt_field: str = "prompt"
    columns: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, dataset: DatasetSpec) -> "RowShape":
        return cls(dataset.prompt_field, tuple(dataset.columns.items()))


def load_rows(path: str | Path, shape: RowShape = RowShape(), field: str = DATASET_FIELD) -> list[Row]:
    """Read and validate every row; raise ConfigError naming `field`, the file and the line/row of the
    first bad one."""
    uri = str(path)
    try:
        check_path(field, uri, Expect.DATASET, credentials=POD_CREDENTIALS)
        fs, root = storage.filesystem(uri)
        files = _files(fs, root)
    except PathError as e:
        raise ConfigError(str(e), reason=e.reason) from None
    except (OSError, ValueError) as e:  # StorageError is a ValueError
        raise ConfigError(
            f"{field} {uri}: cannot read the dataset: {e}", reason=Reason.PATH_UNREADABLE
        ) from e
    rows = []
    for file in files:
        label = uri if file == root else storage.join(uri, file[len(root) :])
        try:
            if file.endswith(PARQUET_SUFFIXES):
                rows += _parquet_rows(fs, file, label, shape)
            else:
                rows += _jsonl_rows(fs, file, label, shape)
        except ConfigError as e:
            raise ConfigError(f"{field} {e}", reason=e.reason) from None
        except OSError as e:
            why = f"{field} {label}: cannot read the dataset: {e}"
            raise ConfigError(why, reason=Reason.PATH_UNREADABLE) from e
    if not rows:
        why = f"{field} {uri}: the dataset has no rows (only blank lines or empty row groups)"
        raise ConfigError(why, reason=Reason.DATASET_EMPTY)
    return rows


def lookup(row: dict[str, Any], path: str) -> Any:
    """The value at a dotted path (dict keys; list indexes as numbers); KeyError naming the part."""
    value: Any = row
    for depth, part in enumerate(path.split(".")):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            where = ".".join(path.split(".")[:depth]) or "the row"
            have = f"keys: {', '.join(map(str, value))}" if isinstance(value, dict) else type(value).__name__
            raise KeyError(f"no {part!r} in {where} ({have})")
    return value


def check_messages(messages: list[Any], what: str) -> Messages:
    """A chat: a non-empty list of {role, content} with known roles and string content (an assistant
    turn may carry tool_calls instead); ValueError naming the message and the field."""
    if not messages:
        raise ValueError(f"{what} is an empty message list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"{what}[{i}] is a {type(m).__name__}, not a {{role, content}} object")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{what}[{i}].role {role!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"{what}[{i}].content must be a string (got {type(content).__name__})")
    return messages


def _row(obj: Any, where: str, shape: RowShape, number: int) -> Row:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    field = shape.prompt_field
    prompt = obj.pop(field, None)
    if isinstance(prompt, list):
        try:
            prompt = check_messages(prompt, f"field {field!r}")
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    elif not isinstance(prompt, str) or not prompt:
        raise ConfigError(
            f"{where}: field {field!r} missing or not a non-empty string or list of chat messages"
        )
    for name, path in shape.columns:
        try:
            obj[name] = lookup(obj, path)
        except KeyError as e:
            raise ConfigError(f"{where}: spec.dataset.columns.{name} ({path}): {e.args[0]}") from None
    return Row(prompt=prompt, columns=obj, line=number, where=where)


def _files(fs: Any, root: str) -> list[str]:
    if not fs.isdir(root):
        if not fs.exists(root):
            raise FileNotFoundError(f"no such file or folder: {root}")
        return [root]
    found = sorted(p for p in fs.find(root) if p.endswith(DATA_SUFFIXES))
    if not found:
        raise FileNotFoundError(f"no {'/'.join(DATA_SUFFIXES)} files in the folder")
    return found


def _jsonl_rows(fs: Any, file: str, label: str, shape: RowShape) -> Iterator[Row]:
    with fs.open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{label}:{number}: not UTF-8: {e.reason}") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{label}:{number}: not valid JSON: {e.msg} (column {e.colno})") from None
            yield _row(obj, f"{label}:{number}", shape, number)


def _parquet_rows(fs: Any, file: str, label: str, shape: RowShape) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with fs.open(file, "rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except (pa.ArrowException, ValueError) as e:
            raise ConfigError(f"{label}: not a readable Parquet file: {e}") from None
        names = parquet.schema_arrow.names
        if shape.prompt_field not in names:
            raise ConfigError(f"{label}: no column {shape.prompt_field!r} (columns: {', '.join(names)})")
        number = 0
        for group in range(parquet.num_row_groups):
            for obj in parquet.read_row_group(group).to_pylist():
                number += 1
                yield _row(obj, f"{label}: row {number}", shape, number)


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
