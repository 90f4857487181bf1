"""Multi-turn episodes with tools on the real pieces: the torch engine, the tiny model's own chat
template, the Hermes parser and the calculator in the sandbox worker.

The tiny model is first taught (supervised, in the test) one trajectory: call the calculator, read
its result, answer with it. Greedy episodes then go: model turn (the call) -> tool message (masked)
-> model turn (the answer). The episode's tokens are the model's and the template's, never
re-rendered text; the tool's are masked with log-prob 0; the trainer's micro-batch leaves them out."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from grpo_rollout import episodes
from grpo_rollout.engines.base import EngineConfig, PromptSamples
from grpo_rollout.engines.torch_engine import TorchEngine
from grpo_rollout.tools.parsers import get_parser
from grpo_rollout.tools.runner import ToolRunner
from grpo_trainer.tiny_model import TinyConfig, build_model, build_tokenizer
from grpo_wire.chat import ChatSettings, PromptRenderer
from grpo_wire.protocol import Prompt, Sampling

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
QUESTION = "What is 6*7?"


def trajectory(tok, renderer: PromptRenderer) -> tuple[list[int], int]:
    """The taught episode's tokens (prompt, call, tool message, answer) and the prompt's length."""
    prompt = renderer.render(Prompt.of("q", QUESTION, {})).token_ids
    end = tok.convert_tokens_to_ids("<|end|>")
    call = [*tok(CALL, add_special_tokens=False).input_ids, end]
    tool = renderer.continuation([{"role": "tool", "content": "42", "name": "calculator"}], "<|end|>")
    answer = [*tok("42", add_special_tokens=False).input_ids, end]
    return prompt + call + tool + answer, len(prompt)


@pytest.fixture(scope="module")
def taught(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ToolRunner]:
    out = tmp_path_factory.mktemp("tool-model")
    tok = build_tokenizer()
    runner = ToolRunner(["calculator"], timeout=10)
    renderer = PromptRenderer(tok, ChatSettings(), tools=runner.schemas)
    seq, _ = trajectory(tok, renderer)
    model = build_model(TinyConfig(max_positions=1024), tok)
    ids = torch.tensor([seq])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(1000):  # memorise the one episode (the loss on every token; the test is greedy)
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(out)
    tok.save_pretrained(out)
    yield out, runner
    runner.close()


@dataclass
class Played:
    result: PromptSamples
    prompt: list[int]
    renderer: PromptRenderer
    want: list[int]  # the taught episode, prompt included
    p: int  # its prompt's length


def play(taught: tuple[Path, ToolRunner], n: int, sampling: Sampling, routing: bool = False) -> Played:
    """n greedy-or-sampled episodes of the taught question on the torch engine, the real calculator."""
    model_dir, runner = taught
    engine = TorchEngine(EngineConfig(model_path=str(model_dir), device="cpu"))
    renderer = PromptRenderer.load(str(model_dir), ChatSettings(), tools=runner.schemas)
    loop = episodes.ToolLoop(renderer, get_parser("hermes"), runner, max_turns=4)
    question = Prompt.of("q", QUESTION, {})
    prompt = renderer.render(question).token_ids
    [result] = episodes.run(engine, [question], [prompt], n, sampling, lambda: False, loop, routing=routing)
    assert result is not None and result.prompt_token_ids == prompt
    want, p = trajectory(engine.tokenizer, renderer)
    return Played(result, prompt, renderer, want, p)


def test_an_episode_calls_the_tool_reads_its_result_and_answers_with_tool_tokens_masked(
    taught: tuple[Path, ToolRunner],
) -> None:
    got = play(taught, 2, Sampling(temperature=0, max_new_tokens=200, seed=1))
    tool = got.renderer.continuation([{"role": "tool", "content": "42", "name": "calculator"}], "<|end|>")
    call = len(got.want) - got.p - len(tool) - 3  # the call turn: everything before the tool message
    for s in got.result.samples:
        assert s.token_ids == got.want[got.p :], got.renderer.decode(s.token_ids)  # token in, token out
        assert (s.turns, s.tool_calls, s.tool_errors, s.text, s.finish_reason) == (2, 1, 0, "42", "stop")
        assert s.mask == [1] * call + [0] * len(tool) + [1] * 3
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask, strict=True) if m == 0)
        assert all(lp <= 0.0 for lp in s.logprobs)


def test_no_room_for_another_turn_drops_the_tool_result_and_ends_at_the_models_turn(
    taught: tuple[Path, ToolRunner],
) -> None:
    tok = build_tokenizer()
    want, p = trajectory(tok, PromptRenderer(tok, ChatSettings(), tools=taught[1].schemas))
    budget = len(want) - p - 3  # the call fits, the tool message does too, no room to answer
    [s] = play(taught, 1, Sampling(temperature=0, max_new_tokens=budget)).result.samples
    assert s.turns == 1 and s.tool_calls == 1 and all(m == 1 for m in s.mask)  # ends with the model's tokens
    assert len(s.token_ids) < budget


def test_the_trainers_micro_batch_leaves_tool_tokens_out_of_the_loss() -> None:
    from grpo_trainer.batch import Rollouts, collate
    from grpo_wire.protocol import Completion, PromptResult

    completion = Completion(
        text="4", token_ids=[5, 6, 7, 8, 9], logprobs=[-1.0, -1.0, 0.0, 0.0, -1.0], mask=[1, 1, 0, 0, 1],
        finish_reason="stop", reward=1.0, turns=2, tool_calls=1,
    )  # fmt: skip
    single = completion.model_copy(update={"mask": None, "turns": 1, "tool_calls": 0})
    results = [PromptResult(prompt_id="0", prompt_token_ids=[1, 2], completions=[completion, single])]
    rollouts = Rollouts.from_bytes(Rollouts.from_results(results, 2, weight_version=0).to_bytes())
    assert rollouts.masks == [[1, 1, 0, 0, 1], [1, 1, 1, 1, 1]]
    mb = collate(rollouts, [0, 1], torch.zeros(2), pad_id=0)
    assert mb.mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 1, 1, 1, 1, 1]]
    assert rollouts.model_tokens(0) == 3
    metrics = rollouts.episode_metrics()
    assert metrics["turns_mean"] == 1.5 and metrics["tool_calls_per_episode"] == 0.5
    assert metrics["masked_token_fraction"] == pytest.approx(2 / 10)


def test_a_local_job_with_tools_runs_episodes_end_to_end_and_reports_them(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The whole path with spec.tools: the rollout server loads the calculator in its sandbox and
    runs episodes, the trainer trains on their masks, the summary carries the episode metrics (the
    demo model never learned to call a tool: one turn each, nothing masked)."""
    from tests.support.local_runtime import job_manifest, run_job

    manifest = job_manifest(tiny_model, maxSteps=3)
    manifest["spec"]["tools"] = [{"builtin": "calculator"}]
    manifest["spec"]["rollout"]["maxTurns"] = 3
    run = run_job(tmp_path, manifest)
    assert run.finish() == 0, run.output()
    summary = run.summary()
    assert summary["steps"] == 3 and summary["restarts"] == 0, summary
    assert summary["turns_mean"] == 1.0 and summary["tool_calls_per_episode"] == 0.0, summary
    assert summary["masked_token_fraction"] == 0.0, summary


def test_routing_replay_covers_every_model_turn_of_an_episode(taught: tuple[Path, ToolRunner]) -> None:
    """The last turn's pass saw the whole episode (earlier turns and tool tokens as its context), so
    its routing has a row for every token the trainer feeds: prompt + completion - 1."""
    from grpo_wire.protocol import Completion, PromptResult

    got = play(taught, 1, Sampling(temperature=0, max_new_tokens=200), routing=True)
    [s] = got.result.samples
    assert s.turns == 2 and s.routing is not None
    assert s.routing.shape[0] == len(got.prompt) + len(s.token_ids) - 1
    completion = Completion(
        text=s.text, token_ids=s.token_ids, logprobs=s.logprobs, mask=s.mask,
        finish_reason=s.finish_reason, reward=1.0, routing=s.routing, turns=s.turns,
    )  # fmt: skip
    PromptResult(prompt_id="q", prompt_token_ids=got.prompt, completions=[completion])  # the wire's own check
