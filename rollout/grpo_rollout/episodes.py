"""Multi-turn episodes with tools: the model writes, calls tools, reads their results, writes again.

Called by the rollout service instead of one `engine.generate` when the job has `spec.tools`. Each
of a prompt's n episodes goes turn by turn: the engine samples a turn from the episode's whole
context (token ids, never re-rendered text: token-in/token-out); the turn's text is parsed for tool
calls (`grpo_rollout.tools.parsers`, spec.rollout.toolCallParser); a turn without calls ends the
episode, else the calls run in the reward sandbox (`grpo_rollout.tools.runner`) and the template's
own continuation (`PromptRenderer.continuation`: the end of the assistant turn, the tool messages,
the opening of the next turn) is appended, masked out (mask 0, logprob 0), and the next turn goes.
An episode ends at a turn without calls, after spec.rollout.maxTurns turns, or when its tokens
(model and tool together) reach maxNewTokens: a tool result that would leave no room for another
turn is dropped and the episode ends at its last model turn (finish `length`), so every episode
ends with the model's own tokens. What a reward sees as the completion is the last turn's text.
"""

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from grpo_rollout.chat import ChatError, PromptRenderer
from grpo_rollout.engines.base import Engine, PromptSamples, Sample
from grpo_rollout.protocol import Sampling
from grpo_rollout.tools.parsers import ToolCallParser
from grpo_rollout.tools.runner import ToolRunner

log = logging.getLogger(__name__)


@dataclass
class ToolLoop:
    """What an episode needs besides the engine: the renderer, the parser, the tools and the bounds."""

    renderer: PromptRenderer
    parser: ToolCallParser
    runner: ToolRunner
    max_turns: int


@dataclass
class Episode:
    context: list[int]  # the prompt's token ids
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    last: Sample | None = None  # the last model turn
    done: bool = False

    def add_turn(self, sample: Sample) -> None:
        self.tokens += sample.token_ids
        self.logprobs += sample.logprobs
        self.mask += [1] * len(sample.token_ids)
        self.turns += 1
        self.last = sample

    def sample(self) -> Sample:
        assert self.last is not None
        return Sample(
            token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.last.finish_reason,
            text=self.last.text,
            routing=self.last.routing,  # the last turn's context covers every token before it
            mask=self.mask,
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
        )


def run(
    engine: Engine,
    prompts: Sequence[list[int]],
    n: int,
    sampling: Sampling,
    should_stop: Callable[[], bool],
    loop: ToolLoop,
    *,
    routing: bool = False,
) -> list[PromptSamples | None]:
    """n episodes per prompt, in order; None for a prompt any of whose episodes was handed back."""
    first = engine.generate(prompts, n, sampling, should_stop, routing=routing)
    episodes: list[list[Episode] | None] = []
    for ids, ps in zip(prompts, first, strict=True):
        if ps is None:
            episodes.append(None)
            continue
        group = [Episode(context=list(ids)) for _ in ps.samples]
        for ep, s in zip(group, ps.samples, strict=True):
            ep.add_turn(s)
        episodes.append(group)
    live = [ep for group in episodes if group is not None for ep in group]
    stopped = False
    with ThreadPoolExecutor(max(1, loop.runner.workers), thread_name_prefix="tools") as pool:
        for turn in range(1, loop.max_turns + 1):
            live = [ep for ep in live if not ep.done]
            for ep, more in zip(live, pool.map(lambda ep: _act(ep, loop, sampling), live), strict=True):
                ep.done = not more
            live = [ep for ep in live if not ep.done]
            if not live or turn == loop.max_turns:
                break
            if not _next_turn(engine, live, sampling, should_stop, turn, routing):
                stopped = True
                break
    out: list[PromptSamples | None] = []
    for ids, group in zip(prompts, episodes, strict=True):
        if group is None or (stopped and any(not ep.done for ep in group)):
            out.append(None)
            continue
        out.append(PromptSamples(prompt_token_ids=list(ids), samples=[ep.sample() for ep in group]))
    return out


def _act(ep: Episode, loop: ToolLoop, sampling: Sampling) -> bool:
    """Run the calls of the episode's last turn and append the continuation; False when the episode
    ends here (no calls, or no room for another turn)."""
    last = ep.last
    assert last is not None
    turn = loop.parser.parse(last.text)
    if not turn.calls and not turn.errors:
        return False
    if last.finish_reason != "stop":  # cut at the token budget mid-call: nothing more fits
        return False
    results = loop.runner.run_turn(turn)
    ep.tool_calls += len(turn.calls)
    ep.tool_errors += results.errors
    stop_text = loop.renderer.decode(last.token_ids[-1:]) if last.token_ids else ""
    try:
        more = loop.renderer.continuation(results.messages(), stop_text)
    except ChatError as e:
        log.warning("episode ends: %s", e)
        return False
    if len(ep.tokens) + len(more) >= sampling.max_new_tokens:
        return False  # no room for the model to answer: the results are dropped, the episode ends
    ep.tokens += more
    ep.logprobs += [0.0] * len(more)
    ep.mask += [0] * len(more)
    return True


def _next_turn(
    engine: Engine,
    live: list[Episode],
    sampling: Sampling,
    should_stop: Callable[[], bool],
    turn: int,
    routing: bool,
) -> bool:
    """One model turn for every live episode, batched by remaining budget; False when stopped."""
    by_budget: dict[int, list[Episode]] = {}
    for ep in live:
        by_budget.setdefault(sampling.max_new_tokens - len(ep.tokens), []).append(ep)
    for budget, group in by_budget.items():
        seed = None if sampling.seed is None else sampling.seed + 7919 * turn
        step = sampling.model_copy(update={"max_new_tokens": budget, "seed": seed})
        contexts = [ep.context + ep.tokens for ep in group]
        answers = engine.generate(contexts, 1, step, should_stop, routing=routing)
        if any(a is None for a in answers):
            return False
        for ep, a in zip(group, answers, strict=True):
            assert a is not None
            ep.add_turn(a.samples[0])
    return True
