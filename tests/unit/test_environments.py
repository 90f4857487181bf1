"""The environment runner (grpo_rollout.environments) on real sandbox workers: episodes that play, and break.

A guessing game is played turn by turn, episodes interleave and stay on the worker that holds them,
and every way an environment goes wrong (a step that hangs, raises, crashes its worker or returns
malformed messages, rewards or flags) ends that episode with an error result, never an exception; a bad
class or bad args fail the runner at start, naming the spec field.
"""

import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from grpo_rollout.environment_host import MAX_MESSAGES, EnvError, EpisodeHost
from grpo_rollout.environments import EnvironmentRunner, StepResult

MEMORY = 256 << 20
TIMEOUT = 2.0
MAX_CHARS = 100

ENVIRONMENTS = '''
import os, time


class Guess:
    """Guess a number from the row; the answer says higher or lower, reward 1 on the right guess."""

    def __init__(self, low=0, high=100):
        self.low, self.high = low, high

    def reset(self, row):
        self.target, self.turns = row["target"], 0
        return [{"role": "user", "content": f"Guess my number, {self.low} to {self.high}."}]

    def step(self, messages):
        self.turns += 1
        guess = int(messages[-1]["content"])
        if guess == self.target:
            return {"messages": [], "reward": 1.0, "done": True}
        hint = "higher" if guess < self.target else "lower"
        return {"messages": [{"role": "user", "content": hint}], "reward": None, "done": False}


class Whoami:
    """Says which process holds the episode."""

    def reset(self, row):
        return [{"role": "user", "content": str(os.getpid())}]

    def step(self, messages):
        content = messages[-1]["content"]
        if content in ("sleep", "nap"):
            time.sleep(60 if content == "sleep" else 1)
        if content == "raise":
            raise RuntimeError("the board is on fire")
        if content == "crash":
            os._exit(3)
        if content == "hog":
            self.hoard = [bytearray(1 << 20) for _ in range(1024)]
        if content == "secret":
            token = str(os.environ.get("GRPO_TOKEN"))
            return {"messages": [{"role": "user", "content": token}], "done": False}
        if content == "huge":
            return {"messages": [{"role": "tool", "content": "z" * 10_000_000}], "done": False}
        if content == "print":
            print("p" * (10 << 20))
        return {"messages": [{"role": "user", "content": str(os.getpid())}], "done": False}


class Garbage:
    """Returns, from step, whatever the row asked for."""

    def reset(self, row):
        self.answer = row["answer"]
        return row.get("opening", [{"role": "system", "content": "go"}])

    def step(self, messages):
        return self.answer


class FailsToStart:
    def __init__(self, fuse):
        self.fuse = fuse

    def reset(self, row):
        raise ValueError(f"no board for {row!r}")

    def step(self, messages):
        return {"messages": [], "done": True}


class NoStep:
    def reset(self, row):
        return []


def not_a_class(row):
    return []
'''


@pytest.fixture(scope="module", autouse=True)
def environment_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("environments")
    (root / "grpo_test_environments.py").write_text(textwrap.dedent(ENVIRONMENTS))
    sys.path.insert(0, str(root))  # the worker is given the parent's sys.path
    yield
    sys.path.remove(str(root))


def make(name: str, args: dict | None = None, **kwargs) -> EnvironmentRunner:
    kwargs = {"timeout": TIMEOUT, "max_message_chars": MAX_CHARS, "memory_bytes": MEMORY, **kwargs}
    return EnvironmentRunner(f"grpo_test_environments:{name}", args or {}, **kwargs)


@pytest.fixture(scope="module")
def whoami():
    runner = make("Whoami", workers=2)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def garbage():
    runner = make("Garbage", workers=1)
    yield runner
    runner.close()


def say(runner: EnvironmentRunner, episode: str, content: str) -> StepResult:
    return runner.step(episode, [{"role": "assistant", "content": content}])


def test_a_guessing_game_is_played_turn_by_turn_to_its_reward():
    runner = make("Guess", {"high": 10}, workers=1)
    try:
        opening = runner.reset("game", {"target": 7})
        assert opening == StepResult([{"role": "user", "content": "Guess my number, 0 to 10."}], None, False)
        hints = [say(runner, "game", str(g)) for g in (5, 9, 7)]
    finally:
        runner.close()
    assert [(h.messages, h.reward, h.done) for h in hints] == [
        ([{"role": "user", "content": "higher"}], None, False),
        ([{"role": "user", "content": "lower"}], None, False),
        ([], 1.0, True),
    ]
    assert runner.errors == 0


def test_interleaved_episodes_keep_their_own_state_and_end_alone():
    runner = make("Guess", workers=1)
    try:
        runner.reset("a", {"target": 3})
        runner.reset("b", {"target": 80})
        assert say(runner, "a", "50").messages[0]["content"] == "lower"
        assert say(runner, "b", "50").messages[0]["content"] == "higher"
        assert say(runner, "a", "3").done
        over = say(runner, "a", "3")  # a done episode's instance is gone
        assert over.done and over.error.startswith("no live episode 'a'")
        assert (say(runner, "b", "80").reward, runner.errors) == (1.0, 1)
    finally:
        runner.close()


def test_episodes_stay_pinned_to_the_worker_that_holds_them(whoami):
    pids = {e: whoami.reset(e, {}).messages[0]["content"] for e in ("p", "q", "r", "s")}
    assert len(set(pids.values())) == 2  # spread over both workers
    for _ in range(3):
        for episode in pids:
            assert say(whoami, episode, "pid").messages[0]["content"] == pids[episode]
    for episode in pids:
        whoami.close(episode)
    assert say(whoami, "p", "pid").error.startswith("no live episode 'p'")


def test_a_step_past_the_timeout_ends_every_episode_on_its_worker_and_the_next_gets_a_fresh_one():
    runner = make("Whoami", workers=1)
    try:
        first = runner.reset("slow", {}).messages[0]["content"]
        runner.reset("bystander", {})
        started = time.monotonic()
        result = say(runner, "slow", "sleep")
        assert time.monotonic() - started < TIMEOUT + 3
        assert result == StepResult(
            [], None, True, "TimeoutError: environment step() took longer than 2s; worker killed"
        )
        lost = say(runner, "bystander", "pid")
        assert lost.done and lost.error.startswith(
            "episode 'bystander' lost its environment: its worker was killed"
        )
        assert "step() of episode 'slow' failed: TimeoutError" in lost.error
        fresh = runner.reset("next", {}).messages[0]["content"]
        assert fresh != first and say(runner, "next", "pid").messages[0]["content"] == fresh
        assert runner.errors == 2
    finally:
        runner.close()


def test_a_step_that_raises_or_crashes_its_worker_ends_its_episode_with_the_reason(whoami):
    whoami.reset("raises", {})
    result = say(whoami, "raises", "raise")
    assert (result.done, result.error) == (True, "step() raised RuntimeError: the board is on fire")
    assert say(whoami, "raises", "pid").error.startswith("no live episode")  # dropped with the failure
    whoami.reset("crashes", {})
    crashed = say(whoami, "crashes", "crash")
    assert crashed.done and crashed.error.startswith("environment worker died during the call")
    whoami.reset("after", {})
    assert not say(whoami, "after", "pid").done


def test_a_step_allocating_past_the_memory_limit_ends_its_episode_alone(whoami):
    whoami.reset("hog", {})
    result = say(whoami, "hog", "hog")
    assert result.error == "MemoryError: over the environment worker's 256 MiB memory limit"
    whoami.reset("after-hog", {})
    assert not say(whoami, "after-hog", "pid").done


def test_a_failing_reset_is_an_error_result_not_an_exception():
    runner = make("FailsToStart", {"fuse": 1}, workers=1)
    try:
        result = runner.reset("e", {"id": 4})
        assert result == StepResult([], None, True, "reset() raised ValueError: no board for {'id': 4}")
        assert say(runner, "e", "1").error.startswith("no live episode 'e'")
    finally:
        runner.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ({"messages": [], "reward": "high", "done": True}, "step() returned reward 'high': not a number"),
        ({"messages": [], "reward": float("inf"), "done": True}, "step() returned reward inf: not finite"),
        ({"messages": [], "done": "yes"}, "step() returned done 'yes': not True or False"),
        ({"messages": [], "done": 1}, "step() returned done 1: not True or False"),
        ({"messages": []}, "step() returned no 'done'"),
        (
            {"messages": [], "done": True, "rewards": 1},
            "step() returned unknown keys ['rewards']; it returns messages, reward, done",
        ),
        ([[], 1.0, True], "step() returned list, not a dict with messages, reward, done"),
        ({"messages": "hi", "done": False}, "step() returned messages of type str, not a list"),
        (
            {"messages": [{"role": "judge", "content": "no"}], "done": False},
            "step() returned message 0 with role 'judge', not one of ['system', 'user', 'assistant', 'tool']",
        ),
        (
            {"messages": [{"role": "user", "content": 3}], "done": False},
            "step() returned message 0 with content of type int",
        ),
        (
            {"messages": [{"role": "user", "content": "a", "name": "b"}], "done": False},
            "step() returned message 0 as ['content', 'name', 'role'], not {'role', 'content'}",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1), "done": False},
            f"step() returned {MAX_MESSAGES + 1} messages; at most {MAX_MESSAGES}",
        ),
    ],
)
def test_a_malformed_step_ends_its_episode_naming_what_was_wrong(garbage, answer, error):
    garbage.reset("g", {"answer": answer})
    result = garbage.step("g", [])
    assert (result.messages, result.reward, result.done, result.error) == ([], None, True, error)


def test_a_well_formed_step_passes_and_an_integer_reward_is_a_float(garbage):
    answer = {"messages": [{"role": "tool", "content": "ok"}], "reward": 2, "done": True}
    garbage.reset("ok", {"answer": answer})
    assert garbage.step("ok", []) == StepResult([{"role": "tool", "content": "ok"}], 2.0, True)


@pytest.mark.parametrize(
    ("opening", "error"),
    [
        ([], "reset() returned no messages: the model needs a prompt"),
        ([{"role": "bot", "content": "x"}], "reset() returned message 0 with role 'bot'"),
        ({"role": "user", "content": "x"}, "reset() returned messages of type dict, not a list"),
    ],
)
def test_a_malformed_reset_is_an_error_result(garbage, opening, error):
    result = garbage.reset("bad-opening", {"answer": None, "opening": opening})
    assert result.done and result.error.startswith(error)


def test_long_messages_are_cut_with_a_visible_marker_and_prints_reach_the_log_cut(whoami, capfd):
    whoami.reset("long", {})
    huge = say(whoami, "long", "huge")
    assert huge.messages == [
        {"role": "tool", "content": "z" * MAX_CHARS + f"\n[truncated {10_000_000 - MAX_CHARS} chars]"}
    ]
    whoami.close()  # a worker started under capfd writes to what it captures
    whoami.reset("chatty", {})
    assert not say(whoami, "chatty", "print").done
    log = capfd.readouterr().err
    assert "environment step of episode 'chatty' printed 10485761 chars: ppp" in log
    assert len(log) < 10_000


def test_what_json_cannot_carry_is_an_error_result_and_leaves_nothing_live(whoami):
    result = whoami.reset("row", {"when": {1, 2}})
    assert result.done and result.error.startswith("TypeError: the reset() arguments are not JSON")
    whoami.reset("msgs", {})
    result = whoami.step("msgs", [{"role": "assistant", "content": b"bytes"}])
    assert result.done and result.error.startswith("TypeError: the step() messages are not JSON")
    assert not whoami.reset("msgs", {}).done  # the worker dropped the first instance


def test_environments_never_see_the_job_token(whoami, monkeypatch):
    monkeypatch.setenv("GRPO_TOKEN", "rollout-token")
    whoami.close()  # the next reset starts workers from this environment
    whoami.reset("spy", {})
    assert say(whoami, "spy", "secret").messages[0]["content"] == "None"


def test_the_same_episode_id_cannot_be_reset_twice_while_live(whoami):
    first = whoami.reset("twice", {})
    again = whoami.reset("twice", {})
    assert again.error == "episode 'twice' is already live"
    assert say(whoami, "twice", "pid").messages == first.messages  # the live one is untouched


def test_episodes_on_two_workers_step_side_by_side():
    runner = make("Whoami", workers=2, timeout=5.0)
    try:
        for episode in ("x", "y"):
            runner.reset(episode, {})
        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            results = list(pool.map(lambda e: say(runner, e, "nap"), ["x", "y"]))
            elapsed = time.monotonic() - started
    finally:
        runner.close()
    assert not any(r.done for r in results)
    assert elapsed < 1.8  # not one after the other


@pytest.mark.parametrize(
    ("name", "args", "error"),
    [
        (
            "Missing",
            {},
            r"spec.environment.class: environment class 'grpo_test_environments:Missing': .*no callable",
        ),
        ("NoStep", {}, r"spec.environment.class: .* has no step method"),
        ("not_a_class", {}, r"spec.environment.class: .* is a function, not a class"),
        ("FailsToStart", {}, r"spec.environment.args: wrong args for .*missing a required argument: 'fuse'"),
        ("Guess", {"size": 3}, r"spec.environment.args: .*unexpected keyword argument 'size'"),
    ],
)
def test_a_bad_class_or_args_fail_the_runner_at_start_naming_the_field(name, args, error):
    with pytest.raises(ValueError, match=error):
        make(name, args)


def test_a_class_whose_module_cannot_be_imported_fails_at_start():
    with pytest.raises(ValueError, match=r"spec.environment.class: .*cannot import module 'no_such_env'"):
        EnvironmentRunner("no_such_env:Game", {}, memory_bytes=MEMORY)


def test_a_worker_keeps_a_bounded_number_of_instances_evicting_the_least_recently_used():
    from grpo_test_environments import Guess

    host = EpisodeHost(max_live=2)  # the worker's own store, in this process: a leak cannot grow it
    for episode in ("old", "used", "new"):
        if episode == "new":
            host.step("old", [{"role": "assistant", "content": "1"}], MAX_CHARS)  # "old" is used again
        host.reset(Guess, {}, episode, {"target": 5}, MAX_CHARS)
    assert list(host.live) == ["old", "new"]
    with pytest.raises(EnvError, match="no live episode 'used'"):
        host.step("used", [{"role": "assistant", "content": "1"}], MAX_CHARS)
