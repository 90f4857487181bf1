"""Interactive environments (spec.environment) on the real pieces: the torch engine, the tiny model's
chat template, the environment's code in the sandbox worker; and a local job whose only reward is
the environment's, which the tiny model learns from.

The environment here asks each answer twice ("Are you sure?") and pays 1 when the second answer is
the row's sum: the model's turns, the environment's message masked out, the reward the episode's."""

from pathlib import Path

import pytest
from grpo_rollout import episodes
from grpo_rollout.engines.base import EngineConfig
from grpo_rollout.engines.torch_engine import TorchEngine
from grpo_rollout.environments import EnvironmentRunner
from grpo_rollout.tools.parsers import get_parser
from grpo_wire.chat import ChatSettings, PromptRenderer
from grpo_wire.protocol import Prompt, Sampling

from tests.support.environments import ARE_YOU_SURE

ENVIRONMENT = ARE_YOU_SURE


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "are_you_sure.py").write_text(ENVIRONMENT)
    monkeypatch.syspath_prepend(str(tmp_path))  # the sandbox worker imports with the server's path
    return tmp_path


def test_an_episode_takes_the_environments_turns_masked_and_its_reward(
    on_path: Path, tiny_model: Path
) -> None:
    engine = TorchEngine(EngineConfig(model_path=str(tiny_model), device="cpu"))
    env = EnvironmentRunner("are_you_sure:AreYouSure", {"question": "Sure?"}, timeout=30)
    try:
        renderer = PromptRenderer.load(str(tiny_model), ChatSettings())
        loop = episodes.ToolLoop(renderer, get_parser("hermes"), None, max_turns=4, environment=env)
        prompt = Prompt.of("p", [{"role": "user", "content": "3+4="}], {"answer": "7"})
        dataset_ids = renderer.render(Prompt.of("p", "ignored: the environment opens", {})).token_ids
        sampling = Sampling(temperature=1.0, max_new_tokens=40, seed=3)
        [result] = episodes.run(
            engine, [prompt], [dataset_ids], 4, sampling, lambda: False, loop, request_id="r"
        )
        assert result is not None
        assert result.prompt_token_ids == renderer.render(prompt).token_ids  # the environment's opening
        asked = renderer.continuation([{"role": "user", "content": "Sure?"}], "<|end|>")
        assert renderer.decode(asked) == "<|user|>Sure?<|end|><|assistant|>"
        for s in result.samples:
            assert s.turns == 2 and s.env_error is None and s.env_reward in (0.0, 1.0)
            first = s.mask.index(0)
            assert s.mask == [1] * first + [0] * len(asked) + [1] * (len(s.mask) - first - len(asked))
            assert s.token_ids[first : first + len(asked)] == asked
            assert s.env_reward == float(s.text == "7")
    finally:
        env.close()


def test_an_episode_the_budget_cuts_says_so(on_path: Path, tiny_model: Path) -> None:
    """The issue-46 case: a budget that holds the model's first turn but not the environment's reply
    as well ends each episode after one turn, and the episode says the budget ended it (length),
    whether the model's turn was cut or the environment's reply did not fit."""
    engine = TorchEngine(EngineConfig(model_path=str(tiny_model), device="cpu"))
    env = EnvironmentRunner("are_you_sure:AreYouSure", {"question": "Are you sure?"}, timeout=30)
    try:
        renderer = PromptRenderer.load(str(tiny_model), ChatSettings())
        loop = episodes.ToolLoop(renderer, get_parser("hermes"), None, max_turns=4, environment=env)
        prompt = Prompt.of("p", [{"role": "user", "content": "3+4="}], {"answer": "7"})
        ids = renderer.render(prompt).token_ids
        [result] = episodes.run(
            engine, [prompt], [ids], 4, Sampling(max_new_tokens=8, seed=3), lambda: False, loop
        )
        assert result is not None
        assert [(s.turns, s.finish_reason) for s in result.samples] == [(1, "length")] * 4
        assert all(s.mask is not None and 0 not in s.mask for s in result.samples)  # the reply was dropped
    finally:
        env.close()


def test_a_reset_that_fails_leaves_the_prompts_episodes_empty_with_the_reason(
    on_path: Path, tiny_model: Path
) -> None:
    engine = TorchEngine(EngineConfig(model_path=str(tiny_model), device="cpu"))
    env = EnvironmentRunner("are_you_sure:AreYouSure", {}, timeout=30)
    try:
        renderer = PromptRenderer.load(str(tiny_model), ChatSettings())
        loop = episodes.ToolLoop(renderer, get_parser("hermes"), None, max_turns=4, environment=env)
        good = Prompt.of("a", [{"role": "user", "content": "1+1="}], {"answer": "2"})
        bad = Prompt.of("b", [{"role": "user", "content": "1+2="}], {})  # no answer column: reset raises
        ids = [renderer.render(p).token_ids for p in (good, bad)]
        out = episodes.run(engine, [good, bad], ids, 2, Sampling(max_new_tokens=20), lambda: False, loop)
        assert out[0] is not None and all(s.turns == 2 for s in out[0].samples)
        assert out[1] is not None and all(s.token_ids == [] and s.env_reward == 0.0 for s in out[1].samples)
        assert all("KeyError" in (s.env_error or "") for s in out[1].samples), out[1].samples[0].env_error
    finally:
        env.close()


def test_a_local_job_learns_from_the_environments_reward_alone(tmp_path: Path, tiny_model: Path) -> None:
    """No reward function: the completion's reward is the environment's (weight 1), the tokens it
    wrote are masked, and the tiny model's addition gets better under it."""
    from tests.support.local_runtime import job_manifest, run_job

    manifest = job_manifest(tiny_model, maxSteps=80, groupSize=8, promptsPerStep=16, microBatchSize=64)
    manifest["spec"]["dataset"]["path"] = str(tiny_model / "addition-train.jsonl")
    del manifest["spec"]["reward"]  # the environment scores: spec.reward may be left out (issue 46)
    manifest["spec"]["environment"] = {"class": "are_you_sure:AreYouSure"}
    manifest["spec"]["algorithm"].update(maxNewTokens=32, learningRate=0.0005)  # two answers and a question
    run = run_job(tmp_path, manifest, files={"are_you_sure.py": ENVIRONMENT})
    assert run.finish(timeout=900) == 0, run.output()
    summary = run.summary()
    assert summary["steps"] == 80 and summary["restarts"] == 0, summary
    assert summary["turns_mean"] == pytest.approx(2.0, abs=0.05), summary  # asked twice, nearly always
    assert 0.0 < summary["masked_token_fraction"] < 1.0, summary
    assert summary["episodes_cut_fraction_mean"] < 0.5, summary  # 32 tokens hold both turns
    rewards = [s["reward_mean"] for s in run.steps()]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, rewards


def test_multi_turn_runs_unchanged_with_dynamic_sampling_evaluation_and_a_resume(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Episodes through the rest of the loop: dynamic sampling concatenates draws (their masks with
    them), the held-out set is scored through the same episodes, and a rerun resumes from the save."""
    from tests.support.local_runtime import job_manifest, run_job

    manifest = job_manifest(tiny_model, maxSteps=4, groupSize=4, promptsPerStep=4, microBatchSize=16)
    spec = manifest["spec"]
    spec["dataset"] = {
        "path": str(tiny_model / "addition-train.jsonl"),
        "eval": {"path": str(tiny_model / "addition-heldout.jsonl"), "everySteps": 2, "samples": 2},
    }
    spec["reward"] = {"functions": []}
    spec["environment"] = {"class": "are_you_sure:AreYouSure"}
    spec["algorithm"].update(maxNewTokens=32, dynamicSampling=True, maxDynamicSamplingDraws=4)
    spec["checkpoint"]["everySteps"] = 2
    run = run_job(tmp_path, manifest, files={"are_you_sure.py": ENVIRONMENT})
    assert run.finish(timeout=900) == 0, run.output()
    summary = run.summary()
    assert summary["steps"] == 4 and summary["eval_reward_first"] is not None, summary
    assert summary["turns_mean"] > 1.5, summary
    spec["algorithm"]["maxSteps"] = 6
    rerun = run_job(tmp_path, manifest, files={"are_you_sure.py": ENVIRONMENT})
    assert rerun.finish(timeout=900) == 0, rerun.output()
    summary = rerun.summary()
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6, summary
    assert summary["turns_mean"] > 1.5, summary
