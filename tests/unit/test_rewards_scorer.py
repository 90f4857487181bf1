"""Reward scoring with broken plugins: raise, hang, wrong length, NaN, crash (grpo_rollout.rewards.scorer).

Plugins and built-ins run in a real child process (the PluginWorker); the hang tests really hang
it and check the worker is killed and replaced. A sample judged out of time (a plugin's `Unjudged`, a
batch past the timeout, a retry cut short) is marked `timed_out`, and the rollout server counts it.
"""

import logging
import sys
import textwrap
import time

import pytest
from grpo_operator.api.spec import RewardSpec
from grpo_rollout.engines.base import EngineConfig, PromptSamples, Sample
from grpo_rollout.rewards.scorer import RewardScorer
from grpo_rollout.rewards.worker import PluginWorker
from grpo_rollout.service import RolloutService, ServiceConfig
from grpo_wire.protocol import GenerateRequest, Prompt, RewardDetail

PLUGINS = """
import math, os, time
from pathlib import Path

from grpo_rollout.rewards.base import Unjudged, warmed_by

def length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]

def raises(prompts, completions, **columns):
    raise RuntimeError("boom")

def picky(prompts, completions, **columns):
    out = []
    for c in completions:
        if c == "bad":
            raise ValueError("cannot parse 'bad'")
        out.append(1.0)
    return out

def hangs(prompts, completions, **columns):
    time.sleep(3600)

def naps(prompts, completions, **columns):
    time.sleep(30)
    return [1.0] * len(completions)

def short(prompts, completions, **columns):
    return [1.0]

def nan_for_x(prompts, completions, **columns):
    return [math.nan if c == "x" else None if c == "skip" else 1.0 for c in completions]

def crash(prompts, completions, **columns):
    os._exit(3)

def uses_columns(prompts, completions, answer, **columns):
    return [float(c == a) for c, a in zip(completions, answer)]

def no_verdict_for_slow(prompts, completions, **columns):
    return [Unjudged("out of my 1 s budget") if c == "slow" else 1.0 for c in completions]

def hangs_alone_on_h(prompts, completions, **columns):
    if len(completions) > 1:
        raise ValueError("one at a time")
    if completions[0] == "h":
        time.sleep(3600)
    return [Unjudged("no verdict") if completions[0] == "u" else 1.0]

def warm_up_slowly():
    with open(os.environ["GRPO_TEST_WARM_LOG"], "a") as f:
        f.write("warmed\\n")
    time.sleep(1.2)

@warmed_by(warm_up_slowly)
def warm(prompts, completions, **columns):
    if completions == ["hang"]:
        time.sleep(3600)
    return [1.0] * len(completions)
"""


@pytest.fixture(scope="module", autouse=True)
def plugin_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins")
    (root / "grpo_test_plugins.py").write_text(textwrap.dedent(PLUGINS))
    sys.path.insert(0, str(root))  # the spawned worker inherits sys.path
    yield
    sys.path.remove(str(root))


def scorer(
    *functions: tuple[str, float], timeout: float = 10.0, worker: PluginWorker | None = None
) -> RewardScorer:
    entries = [
        {"builtin": name} if ":" not in name else {"function": name, "weight": weight}
        for name, weight in functions
    ]
    for entry, (_, weight) in zip(entries, functions, strict=True):
        entry["weight"] = weight
    return RewardScorer(RewardSpec.model_validate({"functions": entries, "timeoutSeconds": timeout}), worker)


def run(s: RewardScorer, completions: list[str], **columns) -> list[tuple[float, list[RewardDetail]]]:
    try:
        return s.score(["p"] * len(completions), completions, columns)
    finally:
        s.close()


def test_weighted_sum_of_builtin_and_plugin_with_columns():
    s = scorer(
        ("exact_match", 2.0), ("grpo_test_plugins:length", 0.5), ("grpo_test_plugins:uses_columns", 1.0)
    )
    out = run(s, ["12", "123"], answer=["12", "12"])
    assert [r for r, _ in out] == [2.0 + 1.0 + 1.0, 0.0 + 1.5 + 0.0]
    assert [d.name for d in out[0][1]] == [
        "exact_match",
        "grpo_test_plugins:length",
        "grpo_test_plugins:uses_columns",
    ]
    assert all(d.error is None for _, details in out for d in details)


def test_raising_plugin_scores_zero_with_reason_and_others_count():
    out = run(scorer(("grpo_test_plugins:raises", 1.0), ("grpo_test_plugins:length", 1.0)), ["ab", "c"])
    assert [r for r, _ in out] == [2.0, 1.0]
    failed = [details[0] for _, details in out]
    assert all(d.score == 0.0 and "RuntimeError: boom" in d.error for d in failed)


def test_one_bad_completion_does_not_zero_its_batch():
    out = run(scorer(("grpo_test_plugins:picky", 1.0)), ["ok", "bad", "ok"])
    assert [r for r, _ in out] == [1.0, 0.0, 1.0]
    assert [d.error for _, (d,) in out] == [None, "ValueError: cannot parse 'bad'", None]


def test_hanging_plugin_times_out_and_its_worker_is_replaced():
    s = scorer(("grpo_test_plugins:hangs", 1.0), ("grpo_test_plugins:length", 1.0), timeout=1.0)
    try:
        t0 = time.monotonic()
        out = s.score(["p", "p"], ["ab", "c"], {})
        assert time.monotonic() - t0 < 5.0
        assert [r for r, _ in out] == [2.0, 1.0]  # the hang scored 0; the next plugin ran on a fresh worker
        assert all("timed out after 1s" in details[0].error for _, details in out)
        assert s._worker.killed == 1
    finally:
        s.close()


class NappingMathWorker(PluginWorker):
    """A worker whose `math` is a function that outlives the timeout (the scorer sends built-ins by name)."""

    def call(self, path: str, *args, **kwargs):
        return super().call("grpo_test_plugins:naps" if path == "math" else path, *args, **kwargs)

    def check(self, path: str, *args, **kwargs):
        return super().check("grpo_test_plugins:naps" if path == "math" else path, *args, **kwargs)


def test_builtins_run_under_the_timeout_too():
    # Run in the server's own process, as built-ins once were, `math` would score 1 after 30 s instead.
    s = scorer(("math", 1.0), ("exact_match", 1.0), timeout=1.0, worker=NappingMathWorker())
    out = run(s, ["7"], answer=["7"])
    ((reward, (math, exact)),) = out
    assert reward == 1.0
    assert math.score == 0.0 and "timed out after 1s" in math.error
    assert exact.score == 1.0 and exact.error is None


def test_an_answer_that_once_stalled_the_math_builtin_is_scored_not_timed_out():
    completions = ["\\boxed{1e999999999}", "\\boxed{\\frac{14}{2}}"]
    out = run(scorer(("math", 1.0), timeout=60.0), completions, answer=["1", "7"])
    assert [r for r, _ in out] == [0.0, 1.0]
    assert all(d.error is None for _, (d,) in out)


def test_wrong_length_zeroes_the_batch_with_reason():
    out = run(scorer(("grpo_test_plugins:short", 1.0)), ["a", "b", "c"])
    assert [r for r, _ in out] == [0.0, 0.0, 0.0]
    assert all(d.error == "returned 1 scores for 3 completions" for _, (d,) in out)


def test_nan_zeroes_only_that_sample_and_none_means_not_applicable():
    out = run(scorer(("grpo_test_plugins:nan_for_x", 3.0)), ["x", "y", "skip"])
    assert [r for r, _ in out] == [0.0, 3.0, 0.0]
    assert [d.error for _, (d,) in out] == ["returned nan", None, None]


def test_plugin_that_kills_its_process_is_reported_and_scoring_goes_on():
    s = scorer(("grpo_test_plugins:crash", 1.0), ("grpo_test_plugins:length", 1.0))
    try:
        out = s.score(["p"], ["abc"], {})
        assert out[0][0] == 3.0
        assert "worker died" in out[0][1][0].error
        assert s._worker.killed == 1
    finally:
        s.close()


def test_unknown_plugin_fails_at_start_with_its_name():
    with pytest.raises(Exception, match="cannot import module 'no_such_module_xyz'"):
        scorer(("no_such_module_xyz:fn", 1.0))
    with pytest.raises(Exception, match="has no callable 'nope'"):
        scorer(("grpo_test_plugins:nope", 1.0))


def test_a_bad_plugin_names_its_spec_field():
    with pytest.raises(Exception, match=r"^spec\.reward\.functions\[1\]\.function: .*has no callable 'nope'"):
        scorer(("exact_match", 1.0), ("grpo_test_plugins:nope", 1.0))


def test_a_sample_returned_unjudged_is_no_verdict_not_a_wrong_answer():
    out = run(
        scorer(("grpo_test_plugins:no_verdict_for_slow", 1.0), ("exact_match", 1.0)),
        ["a", "slow"],
        answer=["a", "x"],
    )
    assert [r for r, _ in out] == [2.0, 0.0]
    (fine, _), (late, exact) = (details for _, details in out)
    assert fine.score == 1.0 and fine.error is None and not fine.timed_out
    assert late.score == 0.0 and late.error == "out of my 1 s budget" and late.timed_out
    assert exact.score == 0.0 and exact.error is None and not exact.timed_out  # a wrong answer: a verdict


def test_a_batch_past_the_timeout_has_no_verdict_for_any_sample():
    out = run(scorer(("grpo_test_plugins:hangs", 1.0), timeout=1.0), ["ab", "c"])
    assert all(d.timed_out and d.score == 0.0 and "timed out after 1s" in d.error for _, (d,) in out)


def test_a_retry_that_runs_out_of_time_marks_what_it_did_not_judge():
    out = run(scorer(("grpo_test_plugins:hangs_alone_on_h", 1.0), timeout=2.0), ["ok", "u", "h", "late"])
    ok, unjudged, hung, late = (d for _, (d,) in out)
    assert (ok.score, ok.error, ok.timed_out) == (1.0, None, False)
    assert (unjudged.score, unjudged.error, unjudged.timed_out) == (0.0, "no verdict", True)
    assert hung.timed_out and "timed out after" in hung.error
    assert late.timed_out and "not retried in time" in late.error and "one at a time" in late.error


def test_a_plugin_that_raises_is_a_failure_not_a_timeout():
    out = run(scorer(("grpo_test_plugins:picky", 1.0)), ["ok", "bad"])
    assert [d.timed_out for _, (d,) in out] == [False, False]


def test_a_rewards_warm_up_runs_at_each_start_on_the_loads_time_not_a_batchs(tmp_path, monkeypatch):
    log = tmp_path / "warm.log"
    monkeypatch.setenv("GRPO_TEST_WARM_LOG", str(log))
    s = scorer(("grpo_test_plugins:warm", 1.0), timeout=1.0)  # warms for 1.2 s: longer than a batch's time
    try:
        assert log.read_text() == "warmed\n"
        assert s.score(["p"], ["hang"], {})[0][1][0].timed_out  # the worker is killed
        ((reward, (detail,)),) = s.score(["p"], ["a"], {})  # a fresh worker: warmed again first
        assert (reward, detail.error) == (1.0, None)
        assert log.read_text() == "warmed\n" * 2
    finally:
        s.close()


def test_the_rollout_server_counts_reward_timeouts_and_warns_once(caplog):
    class TimingOut:
        def score(self, prompts, completions, columns):
            late = RewardDetail(name="math", weight=1.0, score=0.0, error="over 1s of CPU", timed_out=True)
            wrong = RewardDetail(name="format", weight=1.0, score=0.0)
            return [(0.0, [late, wrong]) for _ in completions]

    config = ServiceConfig("r0", "torch", EngineConfig("unused"), RewardSpec(functions=[{"builtin": "math"}]))
    service = RolloutService(config)
    service.scorer = TimingOut()
    request = GenerateRequest(request_id="r", prompts=[Prompt(id="a", text="q")], n=2)
    samples = [PromptSamples([1], [Sample([2], [0.0], "stop", "x"), Sample([3], [0.0], "stop", "y")])]
    with caplog.at_level(logging.WARNING, logger="grpo_rollout.service"):
        for _ in range(2):
            (result,) = service._score(request, samples, 0)
    assert all(c.reward_details[0].timed_out for c in result.completions)
    value = service.metrics.registry.get_sample_value
    assert value("grpo_rollout_reward_timeouts_total", {"function": "math"}) == 4
    assert value("grpo_rollout_reward_failures_total", {"function": "math"}) == 4
    assert value("grpo_rollout_reward_timeouts_total", {"function": "format"}) is None
    (warning,) = [r.getMessage() for r in caplog.records if "ran out of time" in r.getMessage()]
    assert "reward math" in warning and "counted as 0" in warning and "reward_timeouts" in warning
