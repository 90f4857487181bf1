"""The job's prompts as the model will receive them, checked before any GPU work.

Rank 0 renders every training (and held-out) row at start-up with the rollout servers' own renderer
(`grpo_wire.chat`: the model's chat template, the job's template arguments and system prompt), so
a template that fails, a message list a model without a template cannot take, or a prompt too long
for the servers is said with the file and the row before the gang forms; `grpo-operator preview`
shows the same rendering (`grpo_trainer.preview`).
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from grpo_operator.api.spec import GRPOJobSpec
from grpo_operator.api.status import Reason
from grpo_wire.chat import ChatError, ChatSettings, PromptRenderer, Rendered
from grpo_wire.protocol import Prompt

from grpo_trainer.config import ConfigError
from grpo_trainer.data import Row

log = logging.getLogger(__name__)


def tool_schemas(spec: GRPOJobSpec) -> list[dict] | None:
    """The JSON schemas the chat template describes spec.tools with, made where the servers make
    them (the tools imported in the reward sandbox, `grpo_rollout.tools.runner`); ConfigError naming
    the tool that cannot be described."""
    if not spec.tools:
        return None
    from grpo_rollout.tools.runner import ToolRunner  # starts a sandbox worker: only for jobs with tools

    paths = [str(t.builtin) if t.builtin is not None else str(t.function) for t in spec.tools]
    try:
        runner = ToolRunner(paths, timeout=spec.reward.timeout_seconds)
    except ValueError as e:
        raise ConfigError(f"spec.{e}") from None
    try:
        return runner.schemas
    finally:
        runner.close()


def renderer_for(spec: GRPOJobSpec, model_dir: str) -> PromptRenderer:
    """The renderer the job's rollout servers use (the tools described), for the model in `model_dir`."""
    tools = tool_schemas(spec)
    try:
        return PromptRenderer.load(model_dir, ChatSettings.of(spec.dataset), tools)
    except ChatError as e:
        raise ConfigError(str(e)) from None
    except (OSError, ValueError) as e:  # transformers: no tokenizer files it can read
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"spec.model.path {model_dir}: cannot load its tokenizer: {why}", reason=Reason.MODEL_INVALID
        ) from None


def render(rows: Sequence[Row], renderer: PromptRenderer) -> list[Rendered]:
    """Every row rendered; a ConfigError naming the row (FILE:LINE) and why for the first that fails."""
    out = []
    for row in rows:
        try:
            out.append(renderer.render(Prompt.of(str(row.line), row.prompt, row.columns)))
        except (ChatError, ValueError) as e:
            raise ConfigError(f"{row.where or f'row {row.line}'}: {e}") from None
    return out


def prompt_limit(spec: GRPOJobSpec) -> int | None:
    """The most prompt tokens a rollout server can take with room for maxNewTokens: the vLLM
    engine's maxModelLen when set (else the model's own, unknown here)."""
    vllm = spec.rollout.vllm
    if str(spec.rollout.engine) != "vllm" or vllm is None or vllm.max_model_len is None:
        return None
    return vllm.max_model_len - spec.algorithm.max_new_tokens


@dataclass(frozen=True)
class Lengths:
    """Prompt lengths in tokens over a dataset, and how many exceed `limit`."""

    count: int
    shortest: int
    longest: int
    mean: float
    limit: int | None
    over: int

    @classmethod
    def of(cls, rendered: Sequence[Rendered], limit: int | None) -> "Lengths":
        sizes = [len(r.token_ids) for r in rendered] or [0]
        over = sum(n > limit for n in sizes) if limit is not None else 0
        return cls(len(rendered), min(sizes), max(sizes), sum(sizes) / len(sizes), limit, over)

    def warning(self, field: str) -> str | None:
        if not self.over:
            return None
        return (
            f"{field}: {self.over} of {self.count} prompts are longer than {self.limit} tokens "
            f"(spec.rollout.vllm.maxModelLen minus spec.algorithm.maxNewTokens; the longest has "
            f"{self.longest}): they are left out, as the rollout servers would refuse them"
        )


class Checker:
    """Rank 0, at start-up: `checker(field, rows)` renders every row of a set as the servers will;
    a ConfigError for a row that cannot be rendered. Prompts too long for the servers are left out
    with a warning (as verl's filter_overlong_prompts does); a set left with no row is a
    ConfigError. Returns the rows kept."""

    def __init__(self, spec: GRPOJobSpec, model_dir: str) -> None:
        self.renderer = renderer_for(spec, model_dir)
        self.limit = prompt_limit(spec)

    def __call__(self, field: str, rows: list[Row]) -> list[Row]:
        rendered = render(rows, self.renderer)
        lengths = Lengths.of(rendered, self.limit)
        how = "through the model's chat template" if self.renderer.uses_template else "as raw text"
        log.info("%s: %d prompts %s, %d-%d tokens (mean %.0f)",
                 field, lengths.count, how, lengths.shortest, lengths.longest, lengths.mean)  # fmt: skip
        if not lengths.over:
            return rows
        log.warning(lengths.warning(field))
        assert self.limit is not None
        fits = [row for row, r in zip(rows, rendered, strict=True) if len(r.token_ids) <= self.limit]
        if not fits:
            raise ConfigError(f"{lengths.warning(field)}; no prompt is left", reason=Reason.DATASET_EMPTY)
        return fits
