"""The tool runner (grpo_rollout.tools.runner) on real sandbox workers: every way a tool call goes wrong.

Tools that sleep past the timeout, allocate past the memory limit, print or return megabytes, raise,
crash their worker or return what JSON cannot carry each cost one "error: ..." result the model reads,
never an exception; the next call is served (by a fresh worker where the last one was killed).
"""

import json
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from grpo_rollout.tools.parsers import HermesParser, ToolCall
from grpo_rollout.tools.runner import ToolRunner

from tests.support.reward_processes import alive

MEMORY = 256 << 20
TIMEOUT = 2.0
MAX_CHARS = 1000

PLUGINS = '''
import os, time


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def hog(megabytes: int) -> int:
    """Allocate memory.

    Args:
        megabytes: How much.
    """
    chunks = [bytearray(1 << 20) for _ in range(megabytes)]
    return len(chunks)


def chatty(megabytes: int) -> str:
    """Print a lot, return a little.

    Args:
        megabytes: How much to print.
    """
    print("p" * (megabytes << 20))
    return "done"


def huge(chars: int) -> str:
    """Return a long string.

    Args:
        chars: Its length.
    """
    return "y" * chars


def broken(x: int) -> int:
    """Raise.

    Args:
        x: Any number.
    """
    raise RuntimeError(f"broken on {x}")


def structured(n: int, label: str = "squares") -> dict:
    """Return JSON data.

    Args:
        n: How many squares.
        label: The key to put them under.
    """
    return {"n": n, label: [i * i for i in range(n)], "unicode": "é✓"}


def unjsonable() -> list:
    """Return a set, which JSON cannot carry."""
    return {1, 2}


def crash() -> str:
    """Exit the worker process."""
    os._exit(3)


def secret() -> str:
    """Read the job token."""
    return str(os.environ.get("GRPO_TOKEN"))


def undocumented(x: int) -> int:
    return x
'''

TOOLS = ["sleepy", "hog", "chatty", "huge", "broken", "structured", "unjsonable", "crash", "secret"]


@pytest.fixture(scope="module", autouse=True)
def plugin_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_plugins")
    (root / "grpo_tool_plugins.py").write_text(textwrap.dedent(PLUGINS))
    sys.path.insert(0, str(root))  # the worker is given the parent's sys.path
    yield
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def runner(plugin_module):
    paths = [f"grpo_tool_plugins:{t}" for t in TOOLS] + ["calculator", "python"]
    r = ToolRunner(paths, timeout=TIMEOUT, max_result_chars=MAX_CHARS, memory_bytes=MEMORY)
    yield r
    r.close()


def call(runner: ToolRunner, name: str, **arguments):
    return runner.call(ToolCall(name, arguments, "call_0"))


def test_every_tool_is_described_for_the_template_by_the_name_the_model_calls(runner):
    assert runner.names == [*TOOLS, "calculator", "python"]
    assert [s["function"]["name"] for s in runner.schemas] == runner.names
    structured = runner.schemas[TOOLS.index("structured")]["function"]
    assert structured["parameters"]["required"] == ["n"]  # `label` has a default


def test_results_are_strings_as_is_and_json_text_otherwise(runner):
    result = call(runner, "structured", n=3)
    assert not result.error
    assert json.loads(result.content) == {"n": 3, "squares": [0, 1, 4], "unicode": "é✓"}
    assert "é✓" in result.content  # not \\u-escaped: the model reads text
    assert call(runner, "huge", chars=5).content == "yyyyy"
    assert call(runner, "calculator", expression="6 * 7").content == "42"
    assert result.message() == {
        "role": "tool",
        "content": result.content,
        "name": "structured",
        "tool_call_id": "call_0",
    }


def test_a_tool_past_its_timeout_is_killed_and_the_next_call_gets_a_fresh_worker(runner):
    started = time.monotonic()
    result = call(runner, "sleepy", seconds=60)
    assert result.error
    assert result.content == "error: TimeoutError: tool 'sleepy' took longer than 2s"
    assert time.monotonic() - started < TIMEOUT + 3
    assert call(runner, "sleepy", seconds=0).content == "awake"


def test_a_tool_allocating_past_the_memory_limit_fails_alone(runner):
    result = call(runner, "hog", megabytes=1024)
    assert result.error
    assert result.content == "error: MemoryError: over the tool worker's 256 MiB memory limit"
    assert call(runner, "hog", megabytes=8).content == "8"


def test_a_tool_printing_10_mb_answers_and_its_prints_reach_the_log_cut(runner, capfd):
    runner.close()  # a worker started under capfd writes to what it captures
    started = time.monotonic()
    result = call(runner, "chatty", megabytes=10)
    assert (result.content, result.error) == ("done", False)
    assert time.monotonic() - started < 10
    log = capfd.readouterr().err  # the worker writes to the server's stderr
    assert "tool 'chatty' printed 10485761 chars: ppp" in log
    assert len(log) < 10_000


def test_a_long_result_is_cut_with_a_visible_marker(runner):
    result = call(runner, "huge", chars=10_000_000)
    assert not result.error
    assert result.content == "y" * MAX_CHARS + f"\n[truncated {10_000_000 - MAX_CHARS} chars]"


@pytest.mark.parametrize(
    ("name", "arguments", "error"),
    [
        ("broken", {"x": 7}, "error: RuntimeError: broken on 7"),
        ("unjsonable", {}, "error: TypeError: tool 'unjsonable' returned set, which is not JSON"),
        ("nope", {}, "error: unknown tool 'nope'; the tools are ['sleepy', "),
        (
            "broken",
            {},
            "error: TypeError: wrong arguments for tool 'broken': missing a required argument: 'x'",
        ),
        (
            "broken",
            {"x": 1, "y": 2},
            "error: TypeError: wrong arguments for tool 'broken': got an unexpected",
        ),
        ("calculator", {"expression": "9**9**9"}, "error: ValueError: result too large"),
        ("calculator", {"expression": "__import__('os')"}, "error: ValueError: only numbers"),
    ],
)
def test_a_failing_call_is_an_error_result_naming_why(runner, name, arguments, error):
    result = call(runner, name, **arguments)
    assert result.error and result.content.startswith(error)
    assert result.name == name and result.call_id == "call_0"


def test_a_tool_that_kills_its_worker_costs_only_its_call(runner):
    result = call(runner, "crash")
    assert result.error and result.content.startswith("error: tool worker died during the call")
    assert call(runner, "structured", n=1).content.startswith('{"n": 1')


def test_tools_never_see_the_job_token(runner, monkeypatch):
    monkeypatch.setenv("GRPO_TOKEN", "rollout-token")
    runner.close()  # the next call starts a worker from this environment
    assert call(runner, "secret").content == "None"
    assert call(runner, "python", code="import os; print(os.environ.get('GRPO_TOKEN'))").content == "None\n"


def test_a_turn_runs_its_calls_in_order_and_reports_its_malformed_ones(runner):
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
        '<tool_call>{"name": "broken", "arguments": {"x": 2}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
        '<tool_call>{"name": "structured", "arguments": "{\\"n\\": 2}"}</tool_call>'
    )
    results = runner.run_turn(HermesParser().parse(text))
    assert [m.get("tool_call_id") for m in results.messages()] == ["call_0", "call_1", "call_2", None]
    assert [r.content[:20] for r in results.results] == [
        "2",
        "error: RuntimeError:",
        '{"n": 2, "squares": ',
        "error: tool call 3: ",
    ]
    assert results.errors == 2


def test_python_runs_code_in_a_fresh_isolated_interpreter(runner):
    assert call(runner, "python", code="print(6 * 7)").content == "42\n"
    result = call(runner, "python", code="import sys\nprint(sys.flags.isolated)\nraise SystemExit('bye')")
    assert not result.error  # the program's failure is its output, for the model to read
    assert result.content == "1\nbye\n\n[exit status 1]"
    traceback = call(runner, "python", code="1 / 0").content
    assert "ZeroDivisionError: division by zero" in traceback and traceback.endswith("[exit status 1]")


def test_python_stops_before_the_deadline_and_returns_what_was_printed(runner):
    result = call(runner, "python", code="print('started', flush=True)\nwhile True: pass")
    assert result.error
    assert result.content.startswith("error: TimeoutError: the program ran longer than 1.5s and was killed")
    assert result.content.endswith("its output so far:\nstarted\n")


def test_python_under_the_memory_limit_and_the_output_cap(runner):
    hog = call(runner, "python", code="x = bytearray(1 << 30)")
    assert "MemoryError" in hog.content and hog.content.endswith("[exit status 1]")
    started = time.monotonic()
    flood = call(runner, "python", code="import sys\nwhile True: sys.stdout.write('z' * 65536)")
    assert time.monotonic() - started < TIMEOUT  # cut at the cap, not run to the deadline
    assert flood.content.startswith("z" * MAX_CHARS) and "[truncated " in flood.content


def test_python_leaves_nothing_running(runner, tmp_path):
    pidfile = tmp_path / "pid"
    code = textwrap.dedent(f"""
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open({str(pidfile)!r}, "w").write(str(p.pid))
        print("left a daemon")
    """)
    assert call(runner, "python", code=code).content == "left a daemon\n"
    assert not alive(int(pidfile.read_text()))


def test_workers_serve_concurrent_turns_side_by_side():
    tools = ["grpo_tool_plugins:sleepy"]
    with ThreadPoolExecutor(2) as pool:
        runner = ToolRunner(tools, timeout=TIMEOUT, workers=2, memory_bytes=MEMORY)
        try:
            list(pool.map(lambda _: call(runner, "sleepy", seconds=0), range(2)))  # both workers started
            started = time.monotonic()
            results = list(pool.map(lambda _: call(runner, "sleepy", seconds=1), range(2)))
            elapsed = time.monotonic() - started
        finally:
            runner.close()
    assert [r.content for r in results] == ["awake", "awake"]
    assert elapsed < 1.8  # not one after the other


@pytest.mark.parametrize(
    ("tools", "error"),
    [
        (
            ["grpo_tool_plugins:undocumented"],
            "tools\\[0\\] 'grpo_tool_plugins:undocumented': .*has no docstring",
        ),
        (["calculator", "grpo_tool_plugins:missing"], "tools\\[1\\] .*has no callable 'missing'"),
        (["no_such_module:f"], "tools\\[0\\] .*cannot import module 'no_such_module'"),
        (
            ["search"],
            "tool 'search' is neither a built-in \\['calculator', 'python'\\] nor 'module:function'",
        ),
        (
            ["python", "grpo_rollout.tools.builtin.python_exec:python"],
            "tools\\[1\\] .*a second tool named 'python'",
        ),
    ],
)
def test_a_bad_tool_fails_the_runner_at_start_naming_it(tools, error):
    with pytest.raises(ValueError, match=error):
        ToolRunner(tools, memory_bytes=MEMORY)
