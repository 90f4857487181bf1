"""Multi-turn episodes: the model writes, calls tools or hears from an environment, and writes again.

Called by the rollout service instead of one `engine.generate` when the job has `spec.tools` or
`spec.environment`. With an environment (`grpo_rollout.environments`, its code in the reward sandbox)
each episode opens with its `reset(row)` messages (a group's n episodes must open alike: GRPO
compares answers to one prompt) and every model turn without tool calls goes to its `step`, whose
messages are appended like tool results and whose rewards add up to the episode's reward; the
episode ends when it says done. An environment that fails (raises, times out, answers garbage) ends
its episode, counted with the tool errors; one whose reset fails leaves its prompt's episodes empty,
scored 0 with the reason (never a failed request). Each
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

from grpo_wire.chat import ChatError, PromptRenderer
from grpo_wire.protocol import Prompt, Sampling

from grpo_rollout.engines.base import Engine, PromptSamples, Sample
from grpo_rollout.environments import EnvironmentRunner
from grpo_rollout.tools.parsers import ToolCallParser
from grpo_rollout.tools.runner import ToolRunner

log = logging.getLogger(__name__)


@dataclass
class ToolLoop:
    """What an episode needs besides the engine: the renderer, the parser, the tools and the bounds."""

    renderer: PromptRenderer
    parser: ToolCallParser
    runner: ToolRunner | None  # spec.tools
    max_turns: int
    environment: EnvironmentRunner | None = None  # spec.environment
    workers: int = 2  # episodes acting (tools, environment steps) at once


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
    key: str = ""  # the environment's episode id
    messages: list[dict] = field(default_factory=list)  # the conversation, for the environment's step
    env_reward: float | None = None  # the sum of the environment's step rewards
    env_error: str | None = None
    out_of_budget: bool = False  # a tool's or environment's reply did not fit the token budget

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
            # the budget ended it: a turn cut at max_new_tokens, or a reply that did not fit after one
            finish_reason="length" if self.out_of_budget else self.last.finish_reason,
            text=self.last.text,
            routing=self.last.routing,  # the last turn's context covers every token before it
            mask=self.mask,
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            env_reward=self.env_reward,
            env_error=self.env_error,
        )


def run(
    engine: Engine,
    prompts: Sequence[Prompt],
    rendered: Sequence[list[int]],
    n: int,
    sampling: Sampling,
    should_stop: Callable[[], bool],
    loop: ToolLoop,
    *,
    routing: bool = False,
    request_id: str = "",
) -> list[PromptSamples | None]:
    """n episodes per prompt, in order; None for a prompt any of whose episodes was handed back.
    `rendered`: the prompts' token ids (replaced by the environment's opening when there is one)."""
    groups: list[list[Episode] | None] = []
    contexts: list[list[int]] = []
    for prompt, ids in zip(prompts, rendered, strict=True):
        group = [Episode(context=list(ids), key=f"{request_id}/{prompt.id}/{j}") for j in range(n)]
        if loop.environment is not None:
            ids = _open(group, prompt, loop)
        groups.append(group)
        contexts.append(ids)
    playing = [i for i, g in enumerate(groups) if g is not None and not all(ep.done for ep in g)]
    first = engine.generate([contexts[i] for i in playing], n, sampling, should_stop, routing=routing)
    for i, ps in zip(playing, first, strict=True):
        group = groups[i]
        assert group is not None
        if ps is None:
            _close(group, loop)
            groups[i] = None
            continue
        for ep, s in zip(group, ps.samples, strict=True):
            ep.add_turn(s)
    live = [ep for i in playing if (group := groups[i]) is not None for ep in group]
    stopped = False
    with ThreadPoolExecutor(max(1, loop.workers), thread_name_prefix="episodes") as pool:
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
    for ids, group in zip(contexts, groups, strict=True):
        if group is not None:
            _close(group, loop)
        if group is None or (stopped and any(not ep.done for ep in group)):
            out.append(None)
            continue
        out.append(PromptSamples(prompt_token_ids=list(ids), samples=[ep.sample() for ep in group]))
    return out


def _open(group: list[Episode], prompt: Prompt, loop: ToolLoop) -> list[int]:
    """Reset the environment for each episode of a group; the opening's token ids. A reset that
    fails, or openings that differ, end the group's episodes empty, with the reason."""
    assert loop.environment is not None
    row = {**prompt.columns, "prompt": prompt.raw}
    openings = [loop.environment.reset(ep.key, row) for ep in group]
    error = next((r.error for r in openings if r.error), None)
    if error is None and any(r.messages != openings[0].messages for r in openings):
        error = "reset(row) opened the episodes of one prompt differently: it must depend on the row only"
    ids = group[0].context
    if error is None:
        try:
            chat = Prompt.of(prompt.id, openings[0].messages, prompt.columns)
            ids = loop.renderer.render(chat).token_ids
        except (ChatError, ValueError) as e:
            error = f"reset(row) returned messages the chat template cannot take: {e}"
    for ep in group:
        ep.env_reward = 0.0
        ep.messages = list(openings[0].messages)
        ep.context = list(ids)
        if error is not None:
            ep.env_error, ep.done = error, True
            ep.last = Sample(token_ids=[], logprobs=[], finish_reason="stop", text="")
    return ids


def _close(group: list[Episode], loop: ToolLoop) -> None:
    if loop.environment is not None:
        for ep in group:
            loop.environment.close(ep.key)


def _act(ep: Episode, loop: ToolLoop, sampling: Sampling) -> bool:
    """After a model turn: run its tool calls, or else step the environment, and append what they
    write; False when the episode ends here (no calls and no environment, the environment done or
    failed, or no room for another turn)."""
    last = ep.last
    assert last is not None
    if last.finish_reason != "stop":  # cut at the token budget: nothing more fits
        return False
    ep.messages.append({"role": "assistant", "content": last.text})
    turn = loop.parser.parse(last.text) if loop.runner is not None else None
    if turn is not None and (turn.calls or turn.errors):
        assert loop.runner is not None
        results = loop.runner.run_turn(turn)
        ep.tool_calls += len(turn.calls)
        ep.tool_errors += results.errors
        written = results.messages()
    elif loop.environment is not None:
        step = loop.environment.step(ep.key, ep.messages)
        ep.env_reward = (ep.env_reward or 0.0) + (step.reward or 0.0)
        if step.error is not None:
            ep.env_error = step.error
            ep.tool_errors += 1
        if step.done:
            return False
        written = step.messages
    else:
        return False
    stop_text = loop.renderer.decode(last.token_ids[-1:]) if last.token_ids else ""
    try:
        more = loop.renderer.continuation(written, stop_text)
    except ChatError as e:
        log.warning("episode ends: %s", e)
        return False
    if len(ep.tokens) + len(more) >= sampling.max_new_tokens:
        ep.out_of_budget = True  # no room for the model to answer: what was written is dropped
        return False
    ep.messages += written
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
